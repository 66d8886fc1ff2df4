//! HTTP tests: the real router (`app(state).oneshot(req)`, no socket) on in-memory SQLite,
//! the memory bus and the memory session store.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use axum::response::Response;
use chrono::Utc;
use futures::StreamExt;
use sb_common::bus::topology::{declare_topology, deliveries_routing_key};
use sb_common::bus::{Bus, PublishOptions};
use sb_common::shutdown::Shutdown;
use sb_gateway::relay::{OutboxRelay, RelayHandle, RelayOptions};
use sb_gateway::{GatewayDeps, GatewayOptions};
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::messages::{
    DeliveryMessage, EventMessage, ResultMessage, RunFacts, decode, decode_events, encode,
};
use sb_protocol::result::AgentRunResult;
use sb_store::{
    ApiKeyRole, EventStatus, EventStatusUpdate, NewRun, NewRunEvent, NewTranscriptItem, RunnerRow,
};
use serde_json::{Value, json};
use tower::ServiceExt;

mod support;

use support::Harness;

async fn harness_with(options: GatewayOptions) -> Harness {
    Harness::start(options).await
}

async fn harness() -> Harness {
    let mut options = GatewayOptions::default();
    options.stream.ledger_poll = Duration::from_millis(200);
    options.stream.keep_alive = Duration::from_secs(1);
    options.stream.route_wait = Duration::from_secs(5);
    harness_with(options).await
}

impl Harness {
    async fn send(&self, request: Request<Body>) -> Response {
        self.app().oneshot(request).await.unwrap()
    }

    fn get(&self, uri: &str) -> Request<Body> {
        Request::get(uri)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
            .body(Body::empty())
            .unwrap()
    }

    fn post_json(&self, uri: &str, body: &Value) -> Request<Body> {
        self.json_request(Method::POST, uri, body)
    }

    fn patch_json(&self, uri: &str, body: &Value) -> Request<Body> {
        self.json_request(Method::PATCH, uri, body)
    }

    fn json_request(&self, method: Method, uri: &str, body: &Value) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .unwrap()
    }

    async fn ingest(&self, body: &Value) -> (StatusCode, Value) {
        let response = self.send(self.post_json("/v1/events", body)).await;
        let status = response.status();
        (status, json_body(response).await)
    }

    async fn ingested(&self, body: &Value) -> EventId {
        let (status, body) = self.ingest(body).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        body["event_id"].as_str().unwrap().parse().unwrap()
    }

    /// `POST /v1/events?stream=true`: the event's id (`x-event-id`) and its stream.
    async fn ingest_streamed(&self, body: &Value) -> (EventId, SseReader) {
        let response = self
            .send(self.post_json("/v1/events?stream=true", body))
            .await;
        let event_id = response.headers()["x-event-id"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        (event_id, SseReader::new(response))
    }

    /// A queued run for a freshly ingested event in conversation `c1`.
    async fn run(&self) -> RunId {
        let event_id = self.ingested(&message("hello")).await;
        self.run_of(event_id).await
    }

    /// What the orchestrator does for `event_id` (in conversation `c1`): a queued run, and
    /// the event `dispatched` to it.
    async fn dispatch(&self, event_id: EventId) -> RunId {
        let run_id = self.run_of(event_id).await;
        self.stores
            .events
            .update_status(
                event_id,
                EventStatusUpdate {
                    run_id: Some(run_id),
                    ..EventStatusUpdate::status(EventStatus::Dispatched)
                },
            )
            .await
            .unwrap();
        run_id
    }

    /// A queued run for `event_id` in conversation `c1`.
    async fn run_of(&self, event_id: EventId) -> RunId {
        let (run, created) = self
            .stores
            .runs
            .create_run(NewRun {
                id: None,
                workspace_id: WorkspaceId::default_workspace(),
                event_id,
                agent_id: None,
                runner_id: "plugin:acme/echo/default".into(),
                pool: "default".into(),
                conversation_id: Some("c1".into()),
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            })
            .await
            .unwrap();
        assert!(created);
        run.id
    }

    async fn store_result(&self, run_id: RunId, sequence: u64, result: AgentRunResult) {
        let result = result.with_run_id(run_id).with_sequence(sequence);
        let new = self
            .stores
            .runs
            .insert_event(NewRunEvent {
                run_id,
                sequence: sequence as i64,
                result_type: result.result_type.clone(),
                data: sb_store::ItemJson::of(&result),
                ends_run: None,
                transcript: None,
            })
            .await
            .unwrap();
        assert!(new);
    }

    /// Publishes a live delivery by hand, as the result sink does after persisting.
    async fn deliver(&self, run_id: RunId, sequence: u64, result: AgentRunResult) {
        let message = DeliveryMessage::from(ResultMessage::new(
            run_id,
            WorkspaceId::default_workspace(),
            Some("c1".into()),
            sequence,
            result,
        ));
        self.publish_delivery(run_id, &message).await;
    }

    async fn publish_delivery(&self, run_id: RunId, message: &DeliveryMessage) {
        self.bus
            .publish(
                &self.topology.deliveries_exchange(),
                &deliveries_routing_key("default", Some("c1"), &run_id),
                encode(message).into(),
                PublishOptions::best_effort(),
            )
            .await
            .unwrap();
    }

    /// Publishes a live delivery by hand, as the result sink does after persisting, naming
    /// the run's triggering event as today's hosts do.
    async fn deliver_of(
        &self,
        run_id: RunId,
        event_id: EventId,
        sequence: u64,
        result: AgentRunResult,
    ) {
        let facts = RunFacts {
            event_id,
            runner_id: "plugin:acme/echo/default".into(),
            thread_id: None,
            bot_id: None,
        };
        let message = DeliveryMessage::from(
            ResultMessage::new(
                run_id,
                WorkspaceId::default_workspace(),
                Some("c1".into()),
                sequence,
                result,
            )
            .with_run(Some(facts)),
        );
        self.publish_delivery(run_id, &message).await;
    }

    async fn relay_round(&self) -> sb_gateway::relay::RoundReport {
        let relay = OutboxRelay::new(
            self.stores.outbox.clone(),
            self.bus.clone(),
            RelayHandle::new(),
            RelayOptions::default(),
        );
        relay.round().await.unwrap()
    }

    /// The bodies of the messages waiting in the events queues, shard by shard.
    fn queued_event_messages(&self) -> Vec<bytes::Bytes> {
        (0..self.topology.options().events_shards.get())
            .flat_map(|k| {
                self.bus
                    .ready_bodies(&self.topology.events_queue(k).name)
                    .unwrap_or_default()
            })
            .collect()
    }

    /// The events waiting in the events queues: a message holds one, or the batch of an
    /// outbox round ([`decode_events`]).
    fn queued_events(&self) -> usize {
        self.queued_event_messages()
            .iter()
            .map(|body| decode_events(body).map_or(1, |events| events.len()))
            .sum()
    }

    /// Waits (at most 5 s, else panics with `failure`) until the events queues hold `n`
    /// events.
    async fn wait_for_queued_events(&self, n: usize, failure: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while self.queued_events() < n {
            assert!(tokio::time::Instant::now() < deadline, "{failure}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn message(text: &str) -> Value {
    json!({
        "event_type": "message.received", "source": "api", "conversation_id": "c1",
        "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann"},
        "input": {"text": text}
    })
}

async fn json_body(response: Response) -> Value {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
}

async fn assert_error(response: Response, status: StatusCode, code: &str, needle: &str) {
    assert_eq!(response.status(), status);
    let body = json_body(response).await;
    assert_eq!(body["code"], code, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(needle),
        "message {message:?} should mention {needle:?}"
    );
}

// ---------------------------------------------------------------------------------------
// SSE reading
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
struct Frame {
    id: Option<String>,
    event: Option<String>,
    data: Value,
}

struct SseReader {
    stream: axum::body::BodyDataStream,
    buffer: String,
}

impl SseReader {
    fn new(response: Response) -> Self {
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        Self {
            stream: response.into_body().into_data_stream(),
            buffer: String::new(),
        }
    }

    /// The next data frame (keep-alive comments skipped), or `None` when the stream ended.
    async fn next(&mut self) -> Option<Frame> {
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut frame = Frame {
                    id: None,
                    event: None,
                    data: Value::Null,
                };
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        frame.id = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("event:") {
                        frame.event = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim_start());
                    }
                }
                if data.is_empty() && frame.event.is_none() {
                    continue; // a comment (keep-alive)
                }
                frame.data = serde_json::from_str(&data).unwrap();
                return Some(frame);
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.stream.next())
                .await
                .expect("stream stalled for 10 s");
            match chunk {
                Some(Ok(bytes)) => self.buffer.push_str(std::str::from_utf8(&bytes).unwrap()),
                Some(Err(e)) => panic!("stream error: {e}"),
                None => return None,
            }
        }
    }

    async fn sequences_until_end(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(frame) = self.next().await {
            out.push(frame.data["sequence"].as_u64().unwrap());
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// Health, auth
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn health_readiness_and_metrics() {
    let h = harness().await;
    let response = h
        .send(Request::get("/healthz").body(Body::empty()).unwrap())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let response = h
        .send(Request::get("/readyz").body(Body::empty()).unwrap())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        json_body(response).await,
        json!({"status": "ready", "checks": {"database": "ok", "bus": "ok", "sessions": "ok"}})
    );
    h.ingested(&message("hi")).await;
    let response = h
        .send(Request::get("/metrics").body(Body::empty()).unwrap())
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let text = String::from_utf8(
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(text.contains("sb_events_ingested_total"), "{text}");
    assert!(text.contains("sb_http_requests_total"), "{text}");
}

#[tokio::test]
async fn every_v1_route_needs_a_valid_key() {
    let h = harness().await;
    for (method, uri) in [
        ("POST", "/v1/events"),
        ("GET", "/v1/events/0190a1b2-0000-7000-8000-000000000000"),
        ("GET", "/v1/runs/0190a1b2-0000-7000-8000-000000000000"),
        (
            "GET",
            "/v1/runs/0190a1b2-0000-7000-8000-000000000000/events",
        ),
        (
            "GET",
            "/v1/runs/0190a1b2-0000-7000-8000-000000000000/stream",
        ),
        ("GET", "/v1/conversations/c1/transcript"),
        ("GET", "/v1/runners"),
        ("GET", "/v1/agents"),
        ("POST", "/v1/agents"),
    ] {
        for auth in [None, Some("Basic abc"), Some("Bearer nope"), Some("Bearer")] {
            let mut request = Request::builder().method(method).uri(uri);
            if let Some(auth) = auth {
                request = request.header(header::AUTHORIZATION, auth);
            }
            let response = h.send(request.body(Body::empty()).unwrap()).await;
            assert_eq!(
                response.headers()[header::WWW_AUTHENTICATE],
                "Bearer",
                "{method} {uri}"
            );
            assert_error(
                response,
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "api key",
            )
            .await;
        }
    }
    // A revoked key stops working (once the revocation is announced, as `DELETE /v1/keys`
    // and `switchboard keys revoke` do; the keys suite covers those).
    let key = h
        .stores
        .tenancy
        .create_api_key(&WorkspaceId::default_workspace(), None, ApiKeyRole::Client)
        .await
        .unwrap();
    let request = |k: &str| {
        Request::get("/v1/agents")
            .header(header::AUTHORIZATION, format!("Bearer {k}"))
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        h.send(request(&key.plaintext)).await.status(),
        StatusCode::OK
    );
    assert!(
        h.stores
            .tenancy
            .revoke(&WorkspaceId::default_workspace(), key.record.id)
            .await
            .unwrap()
    );
    sb_gateway::auth::announce_revocation(h.sessions.as_ref())
        .await
        .unwrap();
    assert_eq!(
        h.send(request(&key.plaintext)).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn unknown_routes_use_the_error_shape() {
    let h = harness().await;
    assert_error(
        h.send(h.get("/v1/nope")).await,
        StatusCode::NOT_FOUND,
        "not_found",
        "route",
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Ingest
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn ingest_stores_the_event_and_relays_it() {
    let h = harness().await;
    let (status, body) = h
        .ingest(&json!({
            "event_type": "message.received", "source": "api", "event_id": "client-1",
            "conversation_id": "c1", "thread_id": null, "bot_id": null,
            "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann"},
            "subject": null, "input": {"text": "hello", "contents": [], "attachments": []},
            "data": {"chat_type": "private", "_secret": 1}, "delivery": {"surface": "api", "supports_streaming": true}
        }))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["status"], "received");
    let event_id: EventId = body["event_id"].as_str().unwrap().parse().unwrap();

    let response = h.send(h.get(&format!("/v1/events/{event_id}"))).await;
    assert_eq!(response.status(), StatusCode::OK);
    let event = json_body(response).await;
    assert_eq!(event["status"], "received");
    assert_eq!(event["run_id"], Value::Null);
    assert_eq!(event["input_summary"], "hello");
    assert_eq!(event["actor_name"], "Ann");
    assert_eq!(event["idempotency_key"], "client-1");

    // The stored envelope is normalized.
    let record = h.stores.events.get(event_id).await.unwrap().unwrap();
    let envelope = record.envelope.unwrap();
    assert_eq!(envelope["data"], json!({"chat_type": "private"}));
    assert_eq!(envelope["workspace_id"], "default");

    // The outbox row becomes a switchboard.event/1 message on the conversation's shard.
    assert_eq!(h.queued_events(), 0);
    let report = h.relay_round().await;
    assert_eq!((report.claimed, report.published, report.failed), (1, 1, 0));
    let shard = sb_common::bus::topology::events_shard(
        "default",
        Some("c1"),
        h.topology.options().events_shards,
    );
    let queue = h.topology.events_queue(shard).name;
    assert_eq!(h.bus.ready_count(&queue), Some(1));
    let mut sub = h
        .bus
        .subscribe(&h.topology.events_queue(shard), Default::default())
        .await
        .unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .unwrap()
        .unwrap();
    let message: EventMessage = decode(&delivery.body).unwrap();
    assert_eq!(message.event_id, event_id);
    assert_eq!(message.workspace_id.as_str(), "default");
    delivery.ack().await.unwrap();
    // Published rows are not published again.
    assert_eq!(h.relay_round().await.claimed, 0);
}

#[tokio::test]
async fn the_relay_task_publishes_right_after_ingest() {
    let h = harness().await;
    let relay = OutboxRelay::new(
        h.stores.outbox.clone(),
        h.bus.clone(),
        h.state.relay().clone(),
        // A long poll interval: only the wake-up can explain a quick publish.
        RelayOptions {
            poll_interval: Duration::from_secs(60),
            ..RelayOptions::default()
        },
    );
    let token = h.shutdown.token();
    let task = tokio::spawn(relay.run(token.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.ingested(&message("one")).await;
    h.ingested(&message("two")).await;
    h.wait_for_queued_events(2, "relay did not publish after the wake-up")
        .await;
    h.shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("relay stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn the_relay_task_marks_published_rows_together_after_the_mark_delay() {
    let h = harness().await;
    let relay = |mark_delay| {
        OutboxRelay::new(
            h.stores.outbox.clone(),
            h.bus.clone(),
            h.state.relay().clone(),
            RelayOptions {
                poll_interval: Duration::from_secs(60),
                mark_delay,
                ..RelayOptions::default()
            },
        )
    };
    // A mark delay longer than the test: published rows stay unmarked (and leased, so no
    // claim takes them) until the relay stops, which marks what it holds.
    let token = h.shutdown.child_token();
    let task = tokio::spawn(relay(Duration::from_secs(600)).run(token.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.ingested(&message("one")).await;
    h.ingested(&message("two")).await;
    h.wait_for_queued_events(2, "relay did not publish").await;
    assert_eq!(
        h.stores.outbox.pending().await.unwrap(),
        2,
        "marked before the delay"
    );
    assert_eq!(
        h.relay_round().await.claimed,
        0,
        "unmarked rows stay leased"
    );
    token.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("relay stops on shutdown")
        .unwrap();
    assert_eq!(
        h.stores.outbox.pending().await.unwrap(),
        0,
        "marked on shutdown"
    );

    // A short delay: rows are marked while the relay runs.
    let token = h.shutdown.child_token();
    let task = tokio::spawn(relay(Duration::from_millis(20)).run(token.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.ingested(&message("three")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.queued_events() < 3 || h.stores.outbox.pending().await.unwrap() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "relay did not mark");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    token.cancel();
    task.await.unwrap();
}

/// The events a relay round claims for one shard go as one message, in the order they
/// were accepted.
#[tokio::test]
async fn a_relay_round_publishes_one_shards_events_as_one_message() {
    let h = harness().await;
    let mut accepted = Vec::new();
    for text in ["one", "two", "three"] {
        accepted.push(h.ingested(&message(text)).await);
    }
    let report = h.relay_round().await;
    assert_eq!((report.claimed, report.published, report.failed), (3, 3, 0));
    let bodies = h.queued_event_messages();
    assert_eq!(bodies.len(), 1, "one message");
    let published: Vec<EventId> = decode_events(&bodies[0])
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(published, accepted);
}

#[tokio::test]
async fn relay_releases_rows_it_cannot_publish() {
    let h = harness().await;
    h.ingested(&message("x")).await;
    // Remove the events exchange's queues: the mandatory publish becomes unroutable.
    for k in 0..h.topology.options().events_shards.get() {
        h.bus
            .delete_queue(&h.topology.events_queue(k).name)
            .await
            .unwrap();
    }
    let report = h.relay_round().await;
    assert_eq!((report.claimed, report.published, report.failed), (1, 0, 1));
    // Released at once: the next round claims it again, and succeeds once the queues exist.
    declare_topology(h.bus.as_ref(), h.topology.options())
        .await
        .unwrap();
    let report = h.relay_round().await;
    assert_eq!((report.claimed, report.published, report.failed), (1, 1, 0));
    assert_eq!(h.queued_events(), 1);
}

#[tokio::test]
async fn ingest_validation_errors_are_400_with_our_shape() {
    let h = harness().await;
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"source": "api", "input": {"text": "x"}}),
            "event_type",
        ),
        (json!({"event_type": 5, "source": "api"}), "event_type"),
        (json!({"event_type": "message.received"}), "source"),
        (
            json!({"event_type": "bad type", "source": "api", "input": {"text": "x"}}),
            "event_type",
        ),
        (
            json!({"event_type": "message.received", "source": "api"}),
            "input",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": 5}}),
            "input.text",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": "x"}, "actor": {"actor_id": "u"}}),
            "actor_type",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": "x"}, "conversation_id": ""}),
            "conversation_id",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": "x"}, "data": [1]}),
            "data",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": "x"}, "surprise": 1}),
            "surprise",
        ),
        (
            json!({"event_type": "message.received", "source": "api", "input": {"text": "x"}, "event_id": "has space"}),
            "event_id",
        ),
        (json!([1, 2]), "invalid request body"),
    ];
    for (body, needle) in cases {
        let response = h.send(h.post_json("/v1/events", &body)).await;
        assert_error(
            response,
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            needle,
        )
        .await;
    }
    // Not JSON at all.
    let request = Request::post("/v1/events")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    assert_error(
        h.send(request).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "not valid json",
    )
    .await;
    // No content type.
    let request = Request::post("/v1/events")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .body(Body::from(message("x").to_string()))
        .unwrap();
    assert_error(
        h.send(request).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "Content-Type",
    )
    .await;
    // Bad idempotency keys.
    for key in ["", "has space", &"k".repeat(129), "é"] {
        let mut request = h.post_json("/v1/events", &message("x"));
        request.headers_mut().insert(
            "idempotency-key",
            axum::http::HeaderValue::from_bytes(key.as_bytes()).unwrap(),
        );
        assert_error(
            h.send(request).await,
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "Idempotency-Key",
        )
        .await;
    }
    // Bad query.
    let response = h
        .send(h.post_json("/v1/events?stream=maybe", &message("x")))
        .await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "stream",
    )
    .await;
    // Nothing was stored.
    assert_eq!(h.relay_round().await.claimed, 0);
}

#[tokio::test]
async fn oversized_bodies_are_413_before_being_read() {
    let h = harness_with(GatewayOptions {
        max_body_bytes: 1024,
        ..GatewayOptions::default()
    })
    .await;
    let big = message(&"x".repeat(2000));
    // Declared length over the limit.
    let response = h.send(h.post_json("/v1/events", &big)).await;
    assert_error(
        response,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "larger than",
    )
    .await;
    // Chunked (no length): cut at the limit while reading.
    let chunks: Vec<Result<String, std::io::Error>> = big
        .to_string()
        .as_bytes()
        .chunks(100)
        .map(|c| Ok(String::from_utf8(c.to_vec()).unwrap()))
        .collect();
    let request = Request::post("/v1/events")
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures::stream::iter(chunks)))
        .unwrap();
    assert!(request.headers().get(header::CONTENT_LENGTH).is_none());
    let response = h.send(request).await;
    assert_error(
        response,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "larger than",
    )
    .await;
    // Under the limit is fine.
    assert_eq!(h.ingest(&message("small")).await.0, StatusCode::ACCEPTED);
}

#[tokio::test]
async fn ingest_is_idempotent_per_workspace() {
    let h = harness().await;
    let with_key = |key: &str| {
        let mut r = h.post_json("/v1/events", &message("hi"));
        r.headers_mut()
            .insert("idempotency-key", key.parse().unwrap());
        r
    };
    let first = h.send(with_key("order-42:attempt.1")).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = json_body(first).await;
    let second = h.send(with_key("order-42:attempt.1")).await;
    assert_eq!(second.status(), StatusCode::ACCEPTED);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(json_body(second).await["event_id"], first["event_id"]);

    // A client event_id dedupes the same way.
    let mut body = message("hi");
    body["event_id"] = json!("client-7");
    let a = h.ingested(&body).await;
    let b = h.ingested(&body).await;
    assert_eq!(a, b);
    assert_ne!(a.to_string(), first["event_id"].as_str().unwrap());

    // One event per key: two outbox rows in all.
    assert_eq!(h.relay_round().await.published, 2);

    // Another workspace with the same key gets its own event, and cannot read ours.
    let other = h
        .stores
        .tenancy
        .create_api_key(
            &WorkspaceId::new("other").unwrap(),
            None,
            ApiKeyRole::Client,
        )
        .await
        .unwrap()
        .plaintext;
    let mut r = with_key("order-42:attempt.1");
    r.headers_mut().insert(
        header::AUTHORIZATION,
        format!("Bearer {other}").parse().unwrap(),
    );
    let theirs = json_body(h.send(r).await).await;
    assert_ne!(theirs["event_id"], first["event_id"]);
    let r = Request::get(format!(
        "/v1/events/{}",
        first["event_id"].as_str().unwrap()
    ))
    .header(header::AUTHORIZATION, format!("Bearer {other}"))
    .body(Body::empty())
    .unwrap();
    assert_error(
        h.send(r).await,
        StatusCode::NOT_FOUND,
        "not_found",
        "not found",
    )
    .await;
}

#[tokio::test]
async fn event_status_follows_routing() {
    let h = harness().await;
    let event_id = h.ingested(&message("hi")).await;
    h.stores
        .events
        .update_status(
            event_id,
            EventStatusUpdate {
                reason: Some("binding.none".into()),
                ..EventStatusUpdate::status(EventStatus::Unrouted)
            },
        )
        .await
        .unwrap();
    let event = json_body(h.send(h.get(&format!("/v1/events/{event_id}"))).await).await;
    assert_eq!(event["status"], "unrouted");
    assert_eq!(event["reason"], "binding.none");
    assert_error(
        h.send(h.get("/v1/events/not-a-uuid")).await,
        StatusCode::NOT_FOUND,
        "not_found",
        "not-a-uuid",
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Agents and runners
// ---------------------------------------------------------------------------------------

async fn register_runner(h: &Harness, id: &str) {
    h.stores
        .runners
        .upsert(RunnerRow {
            id: id.into(),
            plugin_id: "acme/echo".into(),
            pool: "default".into(),
            version: "1.0.0".into(),
            descriptor: json!({"id": id, "label": {"en_US": "Echo"}}),
            seen_at: Utc::now(),
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn agents_create_list_conflict_and_unknown_runner() {
    let h = harness().await;
    register_runner(&h, "plugin:acme/echo/default").await;

    let runners = json_body(h.send(h.get("/v1/runners")).await).await;
    assert_eq!(runners["items"][0]["runner_id"], "plugin:acme/echo/default");
    assert_eq!(runners["items"][0]["pool"], "default");

    let agent = |name: &str, scope: Value| {
        json!({
            "name": name, "runner_id": "plugin:acme/echo/default", "runner_config": {"timeout": 30},
            "event_types": ["message.received"], "scope": scope,
            "filters": [{"field": "data.chat_type", "value": "private"}],
            "resource_policy": {"allowed_tool_names": ["search"]},
            "state_policy": {"enable_state": true, "state_scopes": ["conversation"]},
            "delivery_policy": {"concurrency": "enqueue"},
            "enabled": true
        })
    };
    let response = h
        .send(h.post_json("/v1/agents", &agent("support", json!({"bot_id": "b1"}))))
        .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let created = json_body(response).await;
    let agent_id = created["agent_id"].as_str().unwrap().to_owned();
    assert_eq!(created["scope"]["bot_id"], "b1");
    assert_eq!(created["delivery_policy"]["concurrency"], "enqueue");

    // Same specificity, overlapping scope and types: ambiguous → 409.
    let response = h
        .send(h.post_json("/v1/agents", &agent("support-2", json!({"bot_id": "b1"}))))
        .await;
    assert_error(response, StatusCode::CONFLICT, "conflict", "support").await;
    // Another bot, a more specific scope, or a disabled agent do not tie.
    for (name, scope) in [
        ("other-bot", json!({"bot_id": "b2"})),
        ("vip", json!({"bot_id": "b1", "actor_id": "u1"})),
    ] {
        assert_eq!(
            h.send(h.post_json("/v1/agents", &agent(name, scope)))
                .await
                .status(),
            StatusCode::CREATED
        );
    }
    let mut disabled = agent("spare", json!({"bot_id": "b1"}));
    disabled["enabled"] = json!(false);
    assert_eq!(
        h.send(h.post_json("/v1/agents", &disabled)).await.status(),
        StatusCode::CREATED
    );

    // Unknown runner → 422; malformed runner id or policy → 400.
    let mut unknown = agent("ghost", json!({"conversation_id": "c9"}));
    unknown["runner_id"] = json!("plugin:acme/ghost/default");
    let response = h.send(h.post_json("/v1/agents", &unknown)).await;
    assert_error(
        response,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_argument",
        "not registered",
    )
    .await;
    let mut malformed = agent("bad", json!({}));
    malformed["runner_id"] = json!("echo");
    assert_error(
        h.send(h.post_json("/v1/agents", &malformed)).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "runner_id",
    )
    .await;
    let mut bad_policy = agent("bad", json!({}));
    bad_policy["delivery_policy"] = json!({"concurrency": "sometimes"});
    assert_error(
        h.send(h.post_json("/v1/agents", &bad_policy)).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "concurrency",
    )
    .await;
    // Names are unique per workspace.
    let response = h
        .send(h.post_json(
            "/v1/agents",
            &agent("support", json!({"conversation_id": "c5"})),
        ))
        .await;
    assert_eq!(response.status(), StatusCode::CONFLICT);

    let list = json_body(h.send(h.get("/v1/agents")).await).await;
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["other-bot", "spare", "support", "vip"]);
    let one = json_body(h.send(h.get(&format!("/v1/agents/{agent_id}"))).await).await;
    assert_eq!(one["name"], "support");
    let delete = Request::delete(format!("/v1/agents/{agent_id}"))
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(delete).await.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        h.send(h.get(&format!("/v1/agents/{agent_id}")))
            .await
            .status(),
        StatusCode::NOT_FOUND
    );
    // With "support" gone, its scope is free again.
    assert_eq!(
        h.send(h.post_json("/v1/agents", &agent("support-2", json!({"bot_id": "b1"}))))
            .await
            .status(),
        StatusCode::CREATED
    );
}

// ---------------------------------------------------------------------------------------
// Runs and transcript
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn runs_and_their_events_page_by_sequence() {
    let h = harness().await;
    let run_id = h.run().await;
    for seq in 1..=4 {
        h.store_result(run_id, seq, AgentRunResult::delta(format!("part {seq}")))
            .await;
    }
    h.store_result(run_id, 5, AgentRunResult::run_completed())
        .await;

    let run = json_body(h.send(h.get(&format!("/v1/runs/{run_id}"))).await).await;
    assert_eq!(run["run_id"], run_id.to_string());
    assert_eq!(run["status"], "queued");
    assert_eq!(run["last_sequence"], 5);
    assert_eq!(run["conversation_id"], "c1");
    // Millisecond companions of the second timestamps.
    let ms = run["created_at_ms"].as_i64().unwrap();
    assert_eq!(ms.div_euclid(1000), run["created_at"].as_i64().unwrap());
    assert!(run["started_at_ms"].is_null() && run["ended_at_ms"].is_null());

    let page = json_body(
        h.send(h.get(&format!(
            "/v1/runs/{run_id}/events?after_sequence=1&limit=2"
        )))
        .await,
    )
    .await;
    let seqs: Vec<u64> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [2, 3]);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["next_cursor"], "3");
    assert_eq!(page["items"][0]["run_id"], run_id.to_string());
    assert_eq!(page["items"][0]["type"], "message.delta");
    assert_eq!(page["items"][0]["data"]["chunk"]["content"], "part 2");
    let page = json_body(
        h.send(h.get(&format!("/v1/runs/{run_id}/events?after_sequence=3")))
            .await,
    )
    .await;
    let seqs: Vec<u64> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [4, 5]);
    assert_eq!(page["has_more"], false);
    assert_eq!(page["next_cursor"], Value::Null);

    let list = json_body(
        h.send(h.get("/v1/runs?conversation_id=c1&status=queued,running"))
            .await,
    )
    .await;
    assert_eq!(list["items"][0]["run_id"], run_id.to_string());
    let response = h.send(h.get("/v1/runs?status=weird")).await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "status",
    )
    .await;
    let response = h
        .send(h.get(&format!("/v1/runs/{run_id}/events?after_sequence=-1")))
        .await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "after_sequence",
    )
    .await;
    let response = h.send(h.get(&format!("/v1/runs/{}", RunId::new()))).await;
    assert_error(response, StatusCode::NOT_FOUND, "not_found", "not found").await;

    // Other workspaces do not see the run.
    let other = h
        .stores
        .tenancy
        .create_api_key(
            &WorkspaceId::new("other").unwrap(),
            None,
            ApiKeyRole::Client,
        )
        .await
        .unwrap()
        .plaintext;
    for uri in [
        format!("/v1/runs/{run_id}"),
        format!("/v1/runs/{run_id}/events"),
        format!("/v1/runs/{run_id}/stream"),
    ] {
        let r = Request::get(&uri)
            .header(header::AUTHORIZATION, format!("Bearer {other}"))
            .body(Body::empty())
            .unwrap();
        assert_eq!(h.send(r).await.status(), StatusCode::NOT_FOUND, "{uri}");
    }
}

#[tokio::test]
async fn transcript_pages_with_opaque_cursors() {
    let h = harness().await;
    for i in 0..5 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        h.stores
            .transcript
            .append(NewTranscriptItem::message(
                WorkspaceId::default_workspace(),
                "c1",
                format!("e{i}"),
                role,
                format!("m{i}"),
            ))
            .await
            .unwrap();
    }
    let page = json_body(
        h.send(h.get("/v1/conversations/c1/transcript?limit=2"))
            .await,
    )
    .await;
    let contents: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["m4", "m3"]);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["items"][0]["role"], "user");
    assert!(page["items"][0]["transcript_id"].is_string());
    let cursor = page["next_cursor"].as_str().unwrap();
    let page = json_body(
        h.send(h.get(&format!(
            "/v1/conversations/c1/transcript?limit=10&cursor={cursor}"
        )))
        .await,
    )
    .await;
    let contents: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["m2", "m1", "m0"]);
    assert_eq!(page["has_more"], false);
    let page = json_body(
        h.send(h.get("/v1/conversations/c1/transcript?direction=forward&limit=2"))
            .await,
    )
    .await;
    assert_eq!(page["items"][0]["content"], "m0");
    let response = h
        .send(h.get("/v1/conversations/c1/transcript?cursor=garbage"))
        .await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "cursor",
    )
    .await;
    let empty = json_body(h.send(h.get("/v1/conversations/nobody/transcript")).await).await;
    assert_eq!(
        empty,
        json!({"items": [], "next_cursor": null, "has_more": false})
    );
}

// ---------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn stream_resumes_without_gap_or_duplicate() {
    let h = harness().await;
    let run_id = h.run().await;
    for seq in 1..=3 {
        h.store_result(run_id, seq, AgentRunResult::delta(format!("p{seq}")))
            .await;
    }
    let mut sse = SseReader::new(
        h.send(h.get(&format!("/v1/runs/{run_id}/stream?after_sequence=1")))
            .await,
    );

    // From the ledger: 2, 3 — framed with id = sequence and event = type.
    let frame = sse.next().await.unwrap();
    assert_eq!(frame.id.as_deref(), Some("2"));
    assert_eq!(frame.event.as_deref(), Some("message.delta"));
    assert_eq!(frame.data["run_id"], run_id.to_string());
    assert_eq!(frame.data["sequence"], 2);
    assert_eq!(frame.data["data"]["chunk"]["content"], "p2");
    assert_eq!(sse.next().await.unwrap().id.as_deref(), Some("3"));

    // Live: a duplicate of 3 is dropped, 4 goes straight through.
    h.deliver(run_id, 3, AgentRunResult::delta("p3")).await;
    h.store_result(run_id, 4, AgentRunResult::delta("p4")).await;
    h.deliver(run_id, 4, AgentRunResult::delta("p4")).await;
    let frame = sse.next().await.unwrap();
    assert_eq!(frame.id.as_deref(), Some("4"));
    assert_eq!(frame.data["data"]["chunk"]["content"], "p4");

    // A gap: 5 and 6 are persisted, only 6 arrives live; 5 is filled from the ledger.
    h.store_result(run_id, 5, AgentRunResult::delta("p5")).await;
    h.store_result(run_id, 6, AgentRunResult::delta("p6")).await;
    h.deliver(run_id, 6, AgentRunResult::delta("p6")).await;
    assert_eq!(sse.next().await.unwrap().id.as_deref(), Some("5"));
    assert_eq!(sse.next().await.unwrap().id.as_deref(), Some("6"));
    // The late live copy of 5 and a repeat of 6 are dropped.
    h.deliver(run_id, 5, AgentRunResult::delta("p5")).await;
    h.deliver(run_id, 6, AgentRunResult::delta("p6")).await;

    // The terminal item ends the stream.
    h.store_result(run_id, 7, AgentRunResult::run_completed())
        .await;
    h.deliver(run_id, 7, AgentRunResult::run_completed()).await;
    let frame = sse.next().await.unwrap();
    assert_eq!(frame.id.as_deref(), Some("7"));
    assert_eq!(frame.event.as_deref(), Some("run.completed"));
    assert_eq!(
        sse.next().await,
        None,
        "the stream closes after the terminal item"
    );

    // Resume with Last-Event-ID (ahead of the URL's after_sequence): only 6 and 7.
    let mut request = h.get(&format!("/v1/runs/{run_id}/stream?after_sequence=1"));
    request
        .headers_mut()
        .insert("last-event-id", "5".parse().unwrap());
    let mut sse = SseReader::new(h.send(request).await);
    assert_eq!(sse.sequences_until_end().await, [6, 7]);

    // A finished run streams entirely from the ledger, then closes.
    let mut sse = SseReader::new(h.send(h.get(&format!("/v1/runs/{run_id}/stream"))).await);
    assert_eq!(sse.sequences_until_end().await, [1, 2, 3, 4, 5, 6, 7]);

    let mut bad = h.get(&format!("/v1/runs/{run_id}/stream"));
    bad.headers_mut()
        .insert("last-event-id", "abc".parse().unwrap());
    assert_error(
        h.send(bad).await,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "Last-Event-ID",
    )
    .await;
}

#[tokio::test]
async fn stream_survives_lost_live_items_through_ledger_polls() {
    let h = harness().await;
    let run_id = h.run().await;
    let mut sse = SseReader::new(h.send(h.get(&format!("/v1/runs/{run_id}/stream"))).await);
    // Give the stream time to bind and read the (empty) ledger.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Persisted but never delivered live (e.g. the broker connection dropped).
    h.store_result(run_id, 1, AgentRunResult::delta("a")).await;
    h.store_result(
        run_id,
        2,
        AgentRunResult::run_failed("runner.crashed", "boom", false),
    )
    .await;
    assert_eq!(sse.next().await.unwrap().id.as_deref(), Some("1"));
    let last = sse.next().await.unwrap();
    assert_eq!(last.event.as_deref(), Some("run.failed"));
    assert_eq!(last.data["data"]["code"], "runner.crashed");
    assert_eq!(sse.next().await, None);
    // The stream's live binding is released.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.state.live().watched_runs() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "live binding not released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn ingest_with_stream_waits_for_routing_then_streams() {
    let h = harness().await;
    let (event_id, mut sse) = h.ingest_streamed(&message("hi")).await;

    // Play the orchestrator and the result sink.
    let (run, _) = h
        .stores
        .runs
        .create_run(NewRun {
            id: None,
            workspace_id: WorkspaceId::default_workspace(),
            event_id,
            agent_id: None,
            runner_id: "plugin:acme/echo/default".into(),
            pool: "default".into(),
            conversation_id: Some("c1".into()),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    h.stores
        .events
        .update_status(
            event_id,
            EventStatusUpdate {
                run_id: Some(run.id),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            },
        )
        .await
        .unwrap();
    h.store_result(run.id, 1, AgentRunResult::delta("hi")).await;
    h.deliver(run.id, 1, AgentRunResult::delta("hi")).await;
    h.store_result(run.id, 2, AgentRunResult::run_completed())
        .await;
    h.deliver(run.id, 2, AgentRunResult::run_completed()).await;
    let first = sse.next().await.unwrap();
    assert_eq!(first.data["run_id"], run.id.to_string());
    assert_eq!(first.data["sequence"], 1);
    assert_eq!(sse.sequences_until_end().await, [2]);
}

/// The wait for the route is woken by the conversation's live items: with the timer and
/// the ledger polls out of the picture (an hour), the run's first delivered item alone gets
/// the stream going.
#[tokio::test]
async fn ingest_with_stream_is_woken_by_the_conversations_live_items() {
    let mut options = GatewayOptions::default();
    options.stream.ledger_poll = Duration::from_secs(3600);
    options.stream.route_poll_min = Duration::from_secs(3600);
    options.stream.route_poll_max = Duration::from_secs(3600);
    options.stream.route_wait = Duration::from_secs(7200);
    let h = harness_with(options).await;
    let (event_id, mut sse) = h.ingest_streamed(&message("hi")).await;
    // Let the stream read the event once (still `received`) and go to sleep.
    tokio::time::sleep(Duration::from_millis(50)).await;

    let (run, _) = h
        .stores
        .runs
        .create_run(NewRun {
            id: None,
            workspace_id: WorkspaceId::default_workspace(),
            event_id,
            agent_id: None,
            runner_id: "plugin:acme/echo/default".into(),
            pool: "default".into(),
            conversation_id: Some("c1".into()),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    h.stores
        .events
        .update_status(
            event_id,
            EventStatusUpdate {
                run_id: Some(run.id),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            },
        )
        .await
        .unwrap();
    h.store_result(run.id, 1, AgentRunResult::delta("hi")).await;
    h.deliver(run.id, 1, AgentRunResult::delta("hi")).await;
    let first = tokio::time::timeout(Duration::from_secs(10), sse.next())
        .await
        .expect("the live item woke the wait")
        .unwrap();
    assert_eq!(first.data["run_id"], run.id.to_string());
    assert_eq!(first.data["sequence"], 1);

    // The conversation's binding also carries the rest of the run.
    h.store_result(run.id, 2, AgentRunResult::run_completed())
        .await;
    h.deliver(run.id, 2, AgentRunResult::run_completed()).await;
    let rest = tokio::time::timeout(Duration::from_secs(10), sse.sequences_until_end())
        .await
        .expect("live items");
    assert_eq!(rest, [2]);
}

/// The run's first item, received by the conversation's registration while the stream waits
/// for the route, is streamed from that delivery: the route read it triggers is the only
/// read, no ledger read follows (the item is deliberately left out of the ledger here, and
/// the ledger polls are an hour away, so only the hand-off can send it).
#[tokio::test]
async fn ingest_with_stream_sends_the_first_live_item_that_found_the_route() {
    let mut options = GatewayOptions::default();
    options.stream.ledger_poll = Duration::from_secs(3600);
    options.stream.route_poll_min = Duration::from_secs(3600);
    options.stream.route_poll_max = Duration::from_secs(3600);
    options.stream.route_wait = Duration::from_secs(7200);
    let h = harness_with(options).await;
    let (event_id, mut sse) = h.ingest_streamed(&message("hi")).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let (run, _) = h
        .stores
        .runs
        .create_run(NewRun {
            id: None,
            workspace_id: WorkspaceId::default_workspace(),
            event_id,
            agent_id: None,
            runner_id: "plugin:acme/echo/default".into(),
            pool: "default".into(),
            conversation_id: Some("c1".into()),
            thread_id: None,
            bot_id: None,
            deadline_at: None,
            attempt: 1,
        })
        .await
        .unwrap();
    h.stores
        .events
        .update_status(
            event_id,
            EventStatusUpdate {
                run_id: Some(run.id),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            },
        )
        .await
        .unwrap();
    h.deliver(run.id, 1, AgentRunResult::delta("live")).await;
    let first = tokio::time::timeout(Duration::from_secs(10), sse.next())
        .await
        .expect("the live item that found the route is sent")
        .unwrap();
    assert_eq!(first.data["sequence"], 1);
    assert!(
        first.data.to_string().contains("\"live\""),
        "{}",
        first.data
    );

    // Later items go on live; a gap is filled from the ledger as usual.
    h.store_result(run.id, 2, AgentRunResult::delta("two"))
        .await;
    h.store_result(run.id, 3, AgentRunResult::run_completed())
        .await;
    h.deliver(run.id, 3, AgentRunResult::run_completed()).await;
    let rest = tokio::time::timeout(Duration::from_secs(10), sse.sequences_until_end())
        .await
        .expect("live items");
    assert_eq!(rest, [2, 3]);
}

/// A busy host: the timer finds the event dispatched before any item of its run arrived.
/// The conversation's registration was in place before the event was committed and missed
/// nothing, so the run streams live from its first item (the ledger is not needed for it:
/// the item is left out of the ledger here, and the ledger polls are an hour away); a gap
/// is still filled from the ledger.
#[tokio::test]
async fn ingest_with_stream_whose_route_was_read_first_streams_live_from_the_first_item() {
    let mut options = GatewayOptions::default();
    options.stream.ledger_poll = Duration::from_secs(3600);
    options.stream.route_poll_min = Duration::from_millis(20);
    options.stream.route_poll_max = Duration::from_millis(20);
    let h = harness_with(options).await;
    let (event_id, mut sse) = h.ingest_streamed(&message("hi")).await;

    // Another run of the conversation streams meanwhile: its items name their own trigger.
    let other = RunId::new();
    h.deliver_of(other, EventId::new(), 1, AgentRunResult::delta("other"))
        .await;
    let run = h.dispatch(event_id).await;
    // Let the timer read the route before the run's first item is delivered.
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.deliver_of(run, event_id, 1, AgentRunResult::delta("live"))
        .await;
    let first = tokio::time::timeout(Duration::from_secs(10), sse.next())
        .await
        .expect("the first item is sent live")
        .unwrap();
    assert_eq!(first.data["sequence"], 1);
    assert!(
        first.data.to_string().contains("\"live\""),
        "{}",
        first.data
    );

    h.store_result(run, 2, AgentRunResult::delta("two")).await;
    h.store_result(run, 3, AgentRunResult::run_completed())
        .await;
    h.deliver_of(run, event_id, 3, AgentRunResult::run_completed())
        .await;
    let rest = tokio::time::timeout(Duration::from_secs(10), sse.sequences_until_end())
        .await
        .expect("live items");
    assert_eq!(rest, [2, 3]);
}

#[tokio::test]
async fn ingest_with_stream_reports_unrouted_events() {
    let h = harness().await;
    let (event_id, mut sse) = h.ingest_streamed(&message("hi")).await;
    h.stores
        .events
        .update_status(
            event_id,
            EventStatusUpdate {
                reason: Some("binding.ambiguous".into()),
                ..EventStatusUpdate::status(EventStatus::Unrouted)
            },
        )
        .await
        .unwrap();
    let frame = sse.next().await.unwrap();
    assert_eq!(frame.event.as_deref(), Some("error"));
    assert_eq!(frame.data["code"], "not_found");
    assert_eq!(frame.data["status"], "unrouted");
    assert_eq!(frame.data["reason"], "binding.ambiguous");
    assert_eq!(frame.data["event_id"], event_id.to_string());
    assert_eq!(sse.next().await, None);
}

#[tokio::test]
async fn streams_end_on_shutdown() {
    let h = harness().await;
    let run_id = h.run().await;
    let mut sse = SseReader::new(h.send(h.get(&format!("/v1/runs/{run_id}/stream"))).await);
    tokio::time::sleep(Duration::from_millis(20)).await;
    h.shutdown.trigger();
    assert_eq!(sse.next().await, None);
}

#[tokio::test]
async fn cancel_records_flags_and_broadcasts() {
    let h = harness().await;
    let run_id = h.run().await;
    // A worker's control queue, bound for every cancel.
    let control = sb_common::bus::QueueSpec::exclusive("test-control").bind(
        h.topology.control_exchange(),
        sb_common::bus::topology::CONTROL_ALL_PATTERN,
    );
    let mut sub = h.bus.subscribe(&control, Default::default()).await.unwrap();

    let cancel = |body: &str| {
        Request::post(format!("/v1/runs/{run_id}/cancel"))
            .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let response = h.send(cancel(r#"{"reason": "user asked"}"#)).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    assert_eq!(
        json_body(response).await,
        json!({"run_id": run_id.to_string(), "cancelled": true, "status": "queued"})
    );
    let flag = sb_common::session::SessionStore::get(
        h.sessions.as_ref(),
        &sb_common::session::cancel_flag_key(&run_id),
    )
    .await
    .unwrap();
    assert_eq!(flag.as_deref(), Some(&b"user asked"[..]));
    let delivery = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .unwrap()
        .unwrap();
    let message: sb_protocol::messages::ControlMessage = decode(&delivery.body).unwrap();
    assert_eq!(
        message,
        sb_protocol::messages::ControlMessage::Cancel {
            run_id,
            reason: "user asked".into()
        }
    );
    delivery.ack().await.unwrap();
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.cancel_reason.as_deref(), Some("user asked"));

    // Repeating is harmless; an empty body is fine.
    assert_eq!(h.send(cancel("")).await.status(), StatusCode::ACCEPTED);
    let response = h.send(cancel(r#"{"why": 1}"#)).await;
    assert_error(response, StatusCode::BAD_REQUEST, "invalid_argument", "why").await;

    // A finished run is never rewritten.
    h.stores
        .runs
        .finish_run(run_id, sb_store::RunOutcome::completed())
        .await
        .unwrap();
    let response = h.send(cancel("")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(json_body(response).await["cancelled"], false);
    let other = RunId::new();
    let r = Request::post(format!("/v1/runs/{other}/cancel"))
        .header(header::AUTHORIZATION, format!("Bearer {}", h.key))
        .body(Body::empty())
        .unwrap();
    assert_eq!(h.send(r).await.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn agents_can_be_patched_under_the_same_rules() {
    let h = harness().await;
    register_runner(&h, "plugin:acme/echo/default").await;
    let create = |name: &str, bot: &str| {
        h.post_json("/v1/agents", &json!({"name": name, "runner_id": "plugin:acme/echo/default", "scope": {"bot_id": bot}}))
    };
    let a = json_body(h.send(create("a", "b1")).await).await;
    let b = json_body(h.send(create("b", "b2")).await).await;
    let patch = |id: &Value, body: Value| {
        h.patch_json(&format!("/v1/agents/{}", id.as_str().unwrap()), &body)
    };
    // Moving b onto a's scope would tie.
    let response = h
        .send(patch(&b["agent_id"], json!({"scope": {"bot_id": "b1"}})))
        .await;
    assert_error(response, StatusCode::CONFLICT, "conflict", "\"a\"").await;
    // Disabled, it may.
    let response = h
        .send(patch(
            &b["agent_id"],
            json!({"scope": {"bot_id": "b1"}, "enabled": false}),
        ))
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let updated = json_body(response).await;
    assert_eq!(updated["scope"]["bot_id"], "b1");
    assert_eq!(updated["enabled"], false);
    assert_eq!(updated["name"], "b");
    // An agent does not conflict with itself.
    let response = h
        .send(patch(
            &a["agent_id"],
            json!({"name": "a2", "runner_config": {"timeout": 5}}),
        ))
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let updated = json_body(response).await;
    assert_eq!(updated["name"], "a2");
    assert_eq!(updated["runner_config"], json!({"timeout": 5}));
    assert_eq!(updated["scope"]["bot_id"], "b1");
    // The same validation as create.
    let response = h
        .send(patch(&a["agent_id"], json!({"colour": "red"})))
        .await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "colour",
    )
    .await;
    let response = h
        .send(patch(&a["agent_id"], json!({"agent_id": "x"})))
        .await;
    assert_error(
        response,
        StatusCode::BAD_REQUEST,
        "invalid_argument",
        "agent_id",
    )
    .await;
    let response = h
        .send(patch(
            &a["agent_id"],
            json!({"runner_id": "plugin:acme/ghost/x"}),
        ))
        .await;
    assert_error(
        response,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_argument",
        "not registered",
    )
    .await;
    let response = h
        .send(patch(
            &json!(RunId::new().to_string()),
            json!({"name": "z"}),
        ))
        .await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn agents_take_partial_budget_overrides() {
    let h = harness().await;
    register_runner(&h, "plugin:acme/echo/default").await;
    let agent = |name: &str, bot: &str, budgets: Option<Value>| {
        let mut body = json!({"name": name, "runner_id": "plugin:acme/echo/default", "scope": {"bot_id": bot}});
        if let Some(b) = budgets {
            body["budgets"] = b;
        }
        body
    };
    // Every malformed override is refused the same way, on create and on patch.
    let refused = |response| {
        assert_error(
            response,
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "budgets",
        )
    };
    // No budgets: no overrides (the defaults apply).
    let plain = json_body(
        h.send(h.post_json("/v1/agents", &agent("plain", "b0", None)))
            .await,
    )
    .await;
    assert_eq!(plain["budgets"], json!({}), "{plain}");

    // A partial object is stored and returned as given; 0 is a legitimate setting.
    let response = h
        .send(h.post_json(
            "/v1/agents",
            &agent(
                "thrifty",
                "b1",
                Some(json!({"max_tool_calls": 1, "max_model_calls": 0})),
            ),
        ))
        .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let created = json_body(response).await;
    assert_eq!(
        created["budgets"],
        json!({"max_tool_calls": 1, "max_model_calls": 0})
    );
    let id = created["agent_id"].as_str().unwrap().to_owned();
    let one = json_body(h.send(h.get(&format!("/v1/agents/{id}"))).await).await;
    assert_eq!(one["budgets"], created["budgets"]);

    // Unknown names, negative, fractional or too large values, and non-objects: 400.
    // (`null` leaves a budget to the deployment's default, like leaving it out.)
    for (i, bad) in [
        json!({"max_tool_callz": 1}),
        json!({"max_tool_calls": -1}),
        json!({"max_tool_calls": 0.5}),
        json!({"max_model_calls": 4_294_967_296_u64}),
        json!([1]),
        json!("lots"),
    ]
    .into_iter()
    .enumerate()
    {
        let body = agent(&format!("bad-{i}"), &format!("x{i}"), Some(bad));
        refused(h.send(h.post_json("/v1/agents", &body)).await).await;
    }

    // PATCH replaces the overrides as a whole, like every other top-level field; `{}`
    // clears them. Other fields keep their overrides.
    let patch = |body: Value| h.patch_json(&format!("/v1/agents/{id}"), &body);
    let response = h.send(patch(json!({"name": "thrifty-2"}))).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(json_body(response).await["budgets"], created["budgets"]);
    let response = h
        .send(patch(json!({"budgets": {"max_tool_result_chars": 500}})))
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        json_body(response).await["budgets"],
        json!({"max_tool_result_chars": 500})
    );
    refused(
        h.send(patch(json!({"budgets": {"max_tool_calls": -3}})))
            .await,
    )
    .await;
    let response = h.send(patch(json!({"budgets": {}}))).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(json_body(response).await["budgets"], json!({}));
    let stored = h
        .stores
        .agents
        .get(&WorkspaceId::default_workspace(), id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.budgets, json!({}));
}

/// Reads from a raw connection until `needle` appears (or fails after 5 s).
async fn read_until(conn: &mut tokio::net::TcpStream, needle: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {:?}", String::from_utf8_lossy(&seen)))
            .unwrap();
        assert!(n > 0, "connection closed before {needle:?}");
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test]
async fn serve_answers_on_a_socket_and_shuts_down_with_open_streams() {
    use tokio::io::AsyncWriteExt;
    let h = harness().await;
    let run_id = h.run().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let deps = GatewayDeps {
        stores: h.stores.clone(),
        bus: h.bus.clone(),
        sessions: h.sessions.clone(),
        topology: h.topology.clone(),
    };
    let shutdown = Shutdown::new();
    let server = tokio::spawn(sb_gateway::serve(
        listener,
        deps,
        GatewayOptions::default(),
        shutdown.clone(),
    ));

    let mut health = tokio::net::TcpStream::connect(addr).await.unwrap();
    health
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until(&mut health, "\"ok\"").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // An open stream of a run that has not finished.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "GET /v1/runs/{run_id}/stream HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {}\r\n\r\n",
        h.key
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    read_until(&mut stream, "text/event-stream").await;

    // The relay of the served gateway publishes what is ingested.
    let (status, _) = h.ingest(&message("via relay")).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.queued_events() < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the served relay did not publish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    shutdown.trigger();
    let result = tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returns promptly although a stream was open")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(
        shutdown.running_tasks().is_empty(),
        "{:?}",
        shutdown.running_tasks()
    );
}
