//! A tiny stand-in for the gateway's event and stream endpoints, for the tests of the
//! gateway client (`tests/client/`: `switchboard::client`, `send`, `bench`).
//!
//! Every event starts one run that behaves like the echo runner (one `message.delta` per
//! word, `message.completed`, `run.completed`), or fails as scripted. The [`Script`] injects
//! the faults the client must survive: dropped or aborted streams, stalls, retryable
//! statuses, unrouted events, resume requests that are ignored, missing items.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{Value, json};

/// The API key the test gateway accepts.
pub const TEST_KEY: &str = "k1";

/// Faults and answers of the test gateway.
#[derive(Debug, Clone)]
pub struct Script {
    /// `POST /v1/events?stream=true` answers with the run's stream (else with a receipt).
    pub stream_on_post: bool,
    /// Final status of every event: `dispatched` (starts a run), `unrouted`, `rejected`.
    pub event_status: &'static str,
    /// `GET /v1/events/{id}` answers `received` (no run yet) this many times per event.
    pub polls_before_run: u32,
    /// Stream connection *i* (POST streams and run streams, counted together) ends after
    /// `drop_after[i]` frames; later connections run to the end.
    pub drop_after: Vec<usize>,
    /// Dropped connections are aborted mid-body instead of ended cleanly.
    pub abort_connection: bool,
    /// Run streams ignore `after_sequence` and `Last-Event-ID` and replay from the start.
    pub ignore_resume: bool,
    /// The first N posts answer `503 unavailable`.
    pub post_failures: u32,
    /// Every stream hangs (open, silent) after this many frames.
    pub stall_after: Option<usize>,
    /// Streams consist of one `event: error` frame.
    pub error_frame: bool,
    /// Streamed posts name the event in an `x-event-id` header.
    pub event_id_header: bool,
    /// Streamed posts answer with the "not routed in time" error frame (the event stays
    /// pollable and is routed).
    pub route_timeout: bool,
    /// Runs end with `run.failed` of this code instead of completing.
    pub fail_with: Option<&'static str>,
    /// The item with this sequence is never sent (a delivery gap).
    pub skip_sequence: Option<u64>,
}

impl Default for Script {
    fn default() -> Self {
        Self {
            stream_on_post: true,
            event_status: "dispatched",
            polls_before_run: 0,
            drop_after: Vec::new(),
            abort_connection: false,
            ignore_resume: false,
            post_failures: 0,
            stall_after: None,
            error_frame: false,
            event_id_header: true,
            route_timeout: false,
            fail_with: None,
            skip_sequence: None,
        }
    }
}

/// What the test gateway saw.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// `POST /v1/events` requests (including refused ones).
    pub posts: u32,
    /// Posts answered with a stream.
    pub stream_posts: u32,
    /// Distinct events created (posts deduplicated by idempotency key).
    pub events_created: u32,
    /// `Idempotency-Key` headers received on accepted posts, in order.
    pub idempotency_keys: Vec<String>,
    /// `GET /v1/events/{id}` requests.
    pub polls: u32,
    /// `GET /v1/runs/{id}/stream` requests.
    pub run_streams: u32,
    /// Their `Last-Event-ID` headers.
    pub last_event_ids: Vec<Option<String>>,
    /// Their `after_sequence` parameters.
    pub after_sequences: Vec<u64>,
    /// Conversation ids of created events.
    pub conversations: Vec<String>,
    /// Texts of created events.
    pub texts: Vec<String>,
}

struct Event {
    run_id: String,
    items: Vec<Value>,
    polls: u32,
}

#[derive(Default)]
struct Inner {
    stats: Stats,
    events: HashMap<String, Event>,
    by_key: HashMap<String, String>,
    runs: HashMap<String, String>,
    connections: usize,
    post_failures_left: Option<u32>,
}

struct Shared {
    script: Script,
    inner: Mutex<Inner>,
}

/// A running test gateway (stops when the test's runtime ends).
pub struct TestGateway {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
}

impl TestGateway {
    /// Starts a gateway on a free loopback port.
    pub async fn start(script: Script) -> Self {
        let shared = Arc::new(Shared {
            script,
            inner: Mutex::new(Inner::default()),
        });
        let app = Router::new()
            .route("/v1/events", post(post_event))
            .route("/v1/events/{id}", get(get_event))
            .route("/v1/runs/{id}/stream", get(run_stream))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { addr, shared }
    }

    /// A URL where nothing listens.
    pub async fn dead_url() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        format!("http://{addr}")
    }

    /// The base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it saw so far.
    pub fn stats(&self) -> Stats {
        self.shared.inner.lock().unwrap().stats.clone()
    }
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(json!({"code": code, "message": message}))).into_response()
}

fn authorized(headers: &HeaderMap) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TEST_KEY}"))
}

/// The run's items: echo deltas, then the completed message and `run.completed`, or a
/// `run.failed`.
fn run_items(run_id: &str, text: &str, script: &Script) -> Vec<Value> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut items: Vec<(&str, Value)> = words
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let chunk = if i + 1 == words.len() {
                (*w).to_owned()
            } else {
                format!("{w} ")
            };
            (
                "message.delta",
                json!({"chunk": {"role": "assistant", "content": chunk}}),
            )
        })
        .collect();
    match script.fail_with {
        Some(code) => items.push((
            "run.failed",
            json!({"code": code, "error": "scripted failure", "retryable": false}),
        )),
        None => {
            items.push((
                "message.completed",
                json!({"message": {"role": "assistant", "content": [{"type": "text", "text": text}]}}),
            ));
            items.push(("run.completed", json!({"finish_reason": "stop"})));
        }
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, (t, data))| json!({"run_id": run_id, "type": t, "data": data, "sequence": i as u64 + 1}))
        .collect()
}

fn status_body(event_id: &str, event: &Event, script: &Script) -> Value {
    if event.polls <= script.polls_before_run {
        return json!({"event_id": event_id, "status": "received"});
    }
    match script.event_status {
        "dispatched" => {
            json!({"event_id": event_id, "status": "dispatched", "run_id": event.run_id})
        }
        other => json!({"event_id": event_id, "status": other, "reason": "no binding matched"}),
    }
}

/// An SSE response of `items` after `after`, with the connection's faults applied.
fn sse(shared: &Shared, items: Vec<Value>, after: u64, error: Option<Value>) -> Response {
    let script = &shared.script;
    let connection = {
        let mut inner = shared.inner.lock().unwrap();
        inner.connections += 1;
        inner.connections - 1
    };
    let mut frames: Vec<String> = vec![": connected\n\n".to_owned()];
    let error = error.or_else(|| {
        script
            .error_frame
            .then(|| json!({"code": "internal", "message": "boom"}))
    });
    if let Some(error) = error {
        frames.push(format!("event: error\ndata: {error}\n\n"));
    } else {
        frames.extend(
            items
                .iter()
                .filter(|i| i["sequence"].as_u64().unwrap() > after)
                .filter(|i| i["sequence"].as_u64() != script.skip_sequence)
                .map(|i| {
                    format!(
                        "id: {}\nevent: {}\ndata: {}\n\n",
                        i["sequence"],
                        i["type"].as_str().unwrap(),
                        i
                    )
                }),
        );
    }
    let drop_at = script.drop_after.get(connection).copied();
    let limit = [drop_at, script.stall_after].into_iter().flatten().min();
    let stream: futures::stream::BoxStream<'static, Result<String, std::io::Error>> = match limit {
        None => futures::stream::iter(frames.into_iter().map(Ok)).boxed(),
        Some(n) => {
            let head = futures::stream::iter(frames.into_iter().take(n + 1).map(Ok));
            if drop_at == Some(n) {
                if script.abort_connection {
                    // Give the server time to flush the frames first: an abort discards
                    // what is still buffered.
                    head.chain(futures::stream::once(async {
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        Err(std::io::Error::other("aborted"))
                    }))
                    .boxed()
                } else {
                    head.boxed()
                }
            } else {
                head.chain(futures::stream::pending()).boxed()
            }
        }
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap()
}

#[derive(Deserialize)]
struct PostQuery {
    #[serde(default)]
    stream: bool,
}

async fn post_event(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<PostQuery>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let script = &shared.script;
    let (items, status, streamed, error, event_id) = {
        let mut inner = shared.inner.lock().unwrap();
        inner.stats.posts += 1;
        if !authorized(&headers) {
            return error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or invalid api key",
            );
        }
        let left = inner.post_failures_left.get_or_insert(script.post_failures);
        if *left > 0 {
            *left -= 1;
            return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "try again");
        }
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        inner.stats.idempotency_keys.push(key.clone());
        let event_id = match inner.by_key.get(&key) {
            Some(id) => id.clone(),
            None => {
                let event_id = uuid::Uuid::new_v4().to_string();
                let run_id = uuid::Uuid::new_v4().to_string();
                let text = body["input"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                inner.stats.events_created += 1;
                inner.stats.texts.push(text.clone());
                inner.stats.conversations.push(
                    body["conversation_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                );
                let items = run_items(&run_id, &text, script);
                inner.runs.insert(run_id.clone(), event_id.clone());
                inner.events.insert(
                    event_id.clone(),
                    Event {
                        run_id,
                        items,
                        polls: 0,
                    },
                );
                inner.by_key.insert(key, event_id.clone());
                event_id
            }
        };
        // Routing is instantaneous here: an event that is not dispatched is answered with
        // its final status right away; like the real gateway, a stream answers it with an
        // error frame naming the event and its status.
        let status = match script.event_status {
            "dispatched" => json!({"event_id": event_id, "status": "received"}),
            other => json!({"event_id": event_id, "status": other, "reason": "no binding matched"}),
        };
        let streamed = query.stream && script.stream_on_post && script.event_status != "claimed";
        let error = if script.route_timeout {
            Some(
                json!({"code": "deadline_exceeded", "message": "not routed in time",
                "event_id": event_id, "status": "received"}),
            )
        } else if script.event_status != "dispatched" {
            let mut e = status.clone();
            e["code"] = json!("not_found");
            e["message"] = json!(format!(
                "event {event_id} was not routed: no binding matched"
            ));
            Some(e)
        } else {
            None
        };
        if streamed {
            inner.stats.stream_posts += 1;
        }
        (
            inner.events[&event_id].items.clone(),
            status,
            streamed,
            error,
            event_id,
        )
    };
    if streamed {
        let mut response = sse(&shared, items, 0, error);
        if script.event_id_header {
            response
                .headers_mut()
                .insert("x-event-id", event_id.parse().unwrap());
        }
        return response;
    }
    (StatusCode::ACCEPTED, Json(status)).into_response()
}

async fn get_event(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or invalid api key",
        );
    }
    let mut inner = shared.inner.lock().unwrap();
    inner.stats.polls += 1;
    let Some(event) = inner.events.get_mut(&id) else {
        return error(StatusCode::NOT_FOUND, "not_found", "no such event");
    };
    event.polls += 1;
    Json(status_body(&id, event, &shared.script)).into_response()
}

#[derive(Deserialize)]
struct StreamQuery {
    #[serde(default)]
    after_sequence: u64,
}

async fn run_stream(
    State(shared): State<Arc<Shared>>,
    Path(run_id): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or invalid api key",
        );
    }
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let items = {
        let mut inner = shared.inner.lock().unwrap();
        inner.stats.run_streams += 1;
        inner.stats.last_event_ids.push(last_event_id.clone());
        inner.stats.after_sequences.push(query.after_sequence);
        let Some(event_id) = inner.runs.get(&run_id).cloned() else {
            return error(StatusCode::NOT_FOUND, "not_found", "no such run");
        };
        inner.events[&event_id].items.clone()
    };
    let after = if shared.script.ignore_resume {
        0
    } else {
        let from_header = last_event_id.and_then(|id| id.parse().ok()).unwrap_or(0);
        query.after_sequence.max(from_header)
    };
    sse(&shared, items, after, None)
}
