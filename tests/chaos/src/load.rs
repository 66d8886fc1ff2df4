//! The load and the stream followers, as a client that expects faults: every request may
//! fail or time out, and is retried until a deadline instead of failing the test, because
//! during a fault that is what a well-behaved client does. What matters is what the API says
//! once it answers.
//!
//! - [`Api`]: the few calls the suite makes, on the cluster's gateways in turn;
//! - [`send_events`]: `count` events at a fixed rate, each with its own conversation and
//!   `Idempotency-Key`, re-posted with the same key until accepted (a lost `202` must not
//!   become a second event);
//! - [`Api::follow`]: one follower per accepted event, reading `GET /v1/runs/{id}/stream` with
//!   the workspace's SSE reader ([`sb_common::sse`]), reconnecting after any break with
//!   `Last-Event-ID` or `?after_sequence` (alternately) from the last sequence it saw; some
//!   followers also drop their first connection on purpose halfway.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sb_common::sse::{LAST_EVENT_ID, SseParser, SseStream};
use sb_protocol::result::AgentRunResult;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::check::FollowerOutcome;

/// Timeout of one API request; a request during a fault may hang until then.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between two attempts of a failed request.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// A stream silent for this long is reconnected (the gateway sends keep-alives).
const STREAM_IDLE: Duration = Duration::from_secs(20);

/// The bot id that routes the load to the test runner's agent.
pub const LOAD_BOT: &str = "chaos";

/// The gateways and the key.
#[derive(Debug, Clone)]
pub struct Api {
    http: reqwest::Client,
    gateways: Vec<String>,
    key: String,
    next: std::sync::Arc<AtomicUsize>,
}

impl Api {
    /// A client of `gateways` (base URLs) with `key`.
    #[must_use]
    pub fn new(gateways: Vec<String>, key: &str) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .expect("an HTTP client");
        Self {
            http,
            gateways,
            key: key.to_owned(),
            next: std::sync::Arc::default(),
        }
    }

    fn gateway(&self) -> &str {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        &self.gateways[n % self.gateways.len()]
    }

    /// One request; `None` when it failed or timed out, else status and JSON body.
    async fn once(&self, builder: reqwest::RequestBuilder) -> Option<(u16, Value)> {
        let response = builder
            .bearer_auth(&self.key)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .ok()?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.ok()?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Some((status, body))
    }

    /// `GET path` until a non-5xx answer or `deadline`.
    pub async fn get(&self, path: &str, deadline: Instant) -> Option<(u16, Value)> {
        loop {
            let url = format!("{}{path}", self.gateway());
            match self.once(self.http.get(url)).await {
                Some((status, body)) if status < 500 && status != 429 => {
                    return Some((status, body));
                }
                _ if Instant::now() >= deadline => return None,
                _ => tokio::time::sleep(RETRY_PAUSE).await,
            }
        }
    }

    /// `POST /v1/events` once; status and body, `None` on a transport failure.
    pub async fn post_event(&self, body: &Value, idempotency_key: &str) -> Option<(u16, Value)> {
        let url = format!("{}/v1/events", self.gateway());
        self.once(
            self.http
                .post(url)
                .header("idempotency-key", idempotency_key)
                .json(body),
        )
        .await
    }

    /// Posts `body` with `idempotency_key` until it is accepted (`202`) or refused for good
    /// (another `4xx`), or `deadline`. Returns the last answer (`None`: never answered).
    pub async fn post_until_answered(
        &self,
        body: &Value,
        idempotency_key: &str,
        deadline: Instant,
    ) -> Option<(u16, Value)> {
        let mut last = None;
        loop {
            let answer = self.post_event(body, idempotency_key).await;
            match &answer {
                Some((status, _)) if *status < 500 && *status != 429 => return answer,
                _ => last = answer.or(last),
            }
            if Instant::now() >= deadline {
                return last;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// The run of `event_id` once it is routed, polled until `deadline`.
    pub async fn run_of(&self, event_id: &str, deadline: Instant) -> Option<String> {
        loop {
            if let Some((200, event)) = self.get(&format!("/v1/events/{event_id}"), deadline).await
            {
                if let Some(run) = event["run_id"].as_str() {
                    return Some(run.to_owned());
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The run ids of `conversation`.
    pub async fn runs_of_conversation(
        &self,
        conversation: &str,
        deadline: Instant,
    ) -> Option<Vec<String>> {
        loop {
            let url = format!("{}/v1/runs", self.gateway());
            let request = self
                .http
                .get(url)
                .query(&[("conversation_id", conversation), ("limit", "100")]);
            if let Some((200, page)) = self.once(request).await {
                let ids = page["items"]
                    .as_array()
                    .map(|items| {
                        items
                            .iter()
                            .filter_map(|r| r["run_id"].as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                return Some(ids);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// `status` of the run.
    pub async fn run_status(&self, run_id: &str, deadline: Instant) -> Option<String> {
        let (status, run) = self.get(&format!("/v1/runs/{run_id}"), deadline).await?;
        (status == 200).then(|| run["status"].as_str().unwrap_or_default().to_owned())
    }

    /// Every stored item of the run, in sequence order (all pages).
    pub async fn run_items(&self, run_id: &str, deadline: Instant) -> Option<Vec<AgentRunResult>> {
        let mut items = Vec::new();
        let mut after = 0u64;
        loop {
            let path = format!("/v1/runs/{run_id}/events?after_sequence={after}&limit=100");
            let (status, page) = self.get(&path, deadline).await?;
            if status != 200 {
                return None;
            }
            let batch: Vec<AgentRunResult> = serde_json::from_value(page["items"].clone()).ok()?;
            let more = page["has_more"] == true;
            after = batch.last().and_then(|i| i.sequence).unwrap_or(after);
            let empty = batch.is_empty();
            items.extend(batch);
            if !more || empty {
                return Some(items);
            }
        }
    }

    /// Follows the run of `event_id` until its terminal item or `deadline` (see the module
    /// docs); `drop_after`: close the first connection after that many frames.
    pub async fn follow(
        &self,
        event_id: &str,
        drop_after: Option<usize>,
        deadline: Instant,
    ) -> FollowerOutcome {
        let mut outcome = FollowerOutcome::default();
        let Some(run_id) = self.run_of(event_id, deadline).await else {
            outcome.gave_up = Some(format!("event {event_id} was never routed"));
            return outcome;
        };
        let mut parser = SseParser::default();
        let mut connections = 0u32;
        loop {
            if Instant::now() >= deadline {
                outcome.gave_up = Some(format!(
                    "run {run_id}: no terminal frame before the deadline"
                ));
                return outcome;
            }
            if connections > 0 {
                outcome.reconnects += 1;
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            connections += 1;
            let last = outcome.sequences.last().copied();
            let mut request = self
                .http
                .get(format!("{}/v1/runs/{run_id}/stream", self.gateway()))
                .bearer_auth(&self.key)
                .header("accept", "text/event-stream");
            // Both ways of resuming, alternately.
            request = match last {
                Some(n) if connections % 2 == 0 => request.header(LAST_EVENT_ID, n.to_string()),
                Some(n) => request.query(&[("after_sequence", n)]),
                None => request,
            };
            let Ok(Ok(response)) = tokio::time::timeout(REQUEST_TIMEOUT, request.send()).await
            else {
                continue;
            };
            if response.status().as_u16() != 200 {
                continue;
            }
            let mut stream =
                SseStream::new(Box::pin(response.bytes_stream()), parser, Some(STREAM_IDLE));
            let mut this_connection = 0usize;
            loop {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let Ok(Ok(Some(event))) =
                    tokio::time::timeout(remaining, stream.next_event()).await
                else {
                    break;
                };
                if event.event == "error" {
                    outcome.error_frames.push(event.data);
                    break;
                }
                let Some(sequence) = event.id.as_deref().and_then(|id| id.parse().ok()) else {
                    outcome.gave_up = Some(format!("a frame without a numeric id: {event:?}"));
                    return outcome;
                };
                outcome.sequences.push(sequence);
                this_connection += 1;
                if matches!(event.event.as_str(), "run.completed" | "run.failed") {
                    outcome.ended_terminal = true;
                    return outcome;
                }
                if connections == 1 && drop_after == Some(this_connection) {
                    break;
                }
            }
            parser = stream.into_parser();
        }
    }
}

/// One event of the load.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Its conversation (unique: one run is expected per conversation).
    pub conversation: String,
    /// The `Idempotency-Key` of every post.
    pub idempotency_key: String,
    /// The body.
    pub body: Value,
    /// Whether the test runner numbers its deltas (`slow <n>`).
    pub numbered: bool,
}

impl Planned {
    /// A `message.received` for the test runner's agent.
    #[must_use]
    pub fn message(conversation: String, text: &str, numbered: bool) -> Self {
        let body = json!({
            "event_type": "message.received",
            "source": "api",
            "bot_id": LOAD_BOT,
            "conversation_id": conversation,
            "actor": {"actor_type": "user", "actor_id": "chaos", "actor_name": "Chaos"},
            "input": {"text": text},
        });
        Self {
            idempotency_key: format!("k-{}", uuid::Uuid::new_v4().simple()),
            conversation,
            body,
            numbered,
        }
    }
}

/// An event the gateway accepted, and what its follower saw.
#[derive(Debug)]
pub struct Accepted {
    /// What was sent.
    pub planned: Planned,
    /// The event id of the `202`.
    pub event_id: String,
    /// The follower's outcome.
    pub follower: FollowerOutcome,
}

/// What [`send_events`] ends with.
#[derive(Debug, Default)]
pub struct Sent {
    /// Accepted events.
    pub accepted: Vec<Accepted>,
    /// Events refused with a `4xx` (status, body), which the load never expects.
    pub refused: Vec<(u16, Value)>,
    /// Events never answered before the deadline.
    pub unanswered: usize,
}

/// Sends `plan` at `rate` per second (each post retried until answered, in its own task so
/// the rate holds during a fault), follows every accepted event from its acceptance on, and
/// signals `halfway` once half of them were started. Posts and followers stop at
/// `deadline`; returns when every follower has finished.
pub async fn send_events(
    api: &Api,
    plan: Vec<Planned>,
    rate: f64,
    deadline: Instant,
    halfway: tokio::sync::oneshot::Sender<()>,
) -> Sent {
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let half = plan.len() / 2;
    let mut halfway = Some(halfway);
    let mut tasks = Vec::with_capacity(plan.len());
    let start = Instant::now();
    for (i, planned) in plan.into_iter().enumerate() {
        tokio::time::sleep_until(start + interval * u32::try_from(i).unwrap_or(u32::MAX)).await;
        if i == half {
            if let Some(tx) = halfway.take() {
                let _ = tx.send(());
            }
        }
        let api = api.clone();
        // Every third follower drops its first connection after a few frames.
        let drop_after = (i % 3 == 0).then_some(3);
        tasks.push(tokio::spawn(async move {
            let answer = api
                .post_until_answered(&planned.body, &planned.idempotency_key, deadline)
                .await;
            let follower = match &answer {
                Some((202, body)) => {
                    let id = body["event_id"].as_str().unwrap_or_default();
                    Some(api.follow(id, drop_after, deadline).await)
                }
                _ => None,
            };
            (planned, answer, follower)
        }));
    }
    if let Some(tx) = halfway.take() {
        let _ = tx.send(());
    }
    let mut sent = Sent::default();
    for task in tasks {
        let Ok((planned, answer, follower)) = task.await else {
            sent.unanswered += 1;
            continue;
        };
        match (answer, follower) {
            (Some((202, body)), Some(follower)) => sent.accepted.push(Accepted {
                planned,
                event_id: body["event_id"].as_str().unwrap_or_default().to_owned(),
                follower,
            }),
            (Some((status, body)), _) => sent.refused.push((status, body)),
            (None, _) => sent.unanswered += 1,
        }
    }
    sent
}
