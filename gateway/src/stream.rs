//! Server-sent event streams of a run's results: ledger first, then live, no gap, no
//! duplicate (SPEC §2 step 5).
//!
//! Frames:
//!
//! ```text
//! id: <sequence>
//! event: <result type>            e.g. message.delta, run.completed
//! data: <AgentRunResult JSON, with run_id and sequence>
//! ```
//!
//! A stream ends after the terminal item (`run.completed` / `run.failed`). Problems that
//! end a stream early (the event was not routed, the results expired, …) are sent as one
//! `event: error` frame with `{code, message, …}` before closing. Keep-alive comments are
//! sent while nothing happens.
//!
//! The algorithm, per stream, with `last` = the last sequence sent (the client's
//! `after_sequence` / `Last-Event-ID` to begin with):
//!
//! 1. register for live items of the run ([`LiveHub::watch`]: the binding is on the
//!    broker when it returns);
//! 2. read the ledger after `last` and send it (pages until exhausted);
//! 3. then for each live item: drop it if `sequence <= last`; send it if it is `last + 1`;
//!    if it is further ahead (a gap: items we missed, e.g. because the channel lagged), read
//!    the ledger after `last` again, which has them, since items are published live only
//!    after they are persisted;
//! 4. every `ledger_poll` without progress, read the ledger anyway: a safety net for live
//!    items lost with a broker connection.
//!
//! Step 1 before step 2 is what makes it gap-free: an item persisted after the ledger read
//! is published after the binding exists. If the run has ended but its terminal item is no
//! longer in the ledger (retention), the stream says so instead of waiting forever.
//!
//! The ledger itself can have a hole for a while: when the database fails mid-batch, the
//! result sink requeues the failed item, and a later item of the run (already prefetched)
//! may be stored first. A stream sends only what continues `last` without a hole
//! ([`dense_prefix`]) and waits for the hole to fill (the next live item or ledger poll
//! reads again); a hole still open after [`HOLE_PATIENCE`] is skipped with a warning, so a
//! stream can never hang on it.
//!
//! `POST /v1/events?stream=true` first has to learn which run handles the event. It registers
//! for live items of the event's whole conversation ([`LiveHub::watch_conversation`])
//! **before** the event is committed, so nothing of the event's run can be published unseen.
//! Every live item names its run's triggering event (`event_id`, carried from the job by the
//! worker and the sink), so the run's first item is the route itself: the usual cost of
//! learning it is no read at all. Any other live item of the conversation (another run's; a
//! run that absorbs the message as steering) makes it read the event's routing state, and a
//! sparse timer ([`route_poll_delay`]) covers what produces no live item (unrouted, rejected,
//! scheduled events), live items lost with a broker connection, and items of older hosts
//! without `event_id`. A repeated idempotency key answers with the first event, whose route
//! may be known already: then the state is read at once. The conversation registration
//! then serves as step 1 for the run's stream: it was in place before anything of the run
//! was persisted. And when the run's item of sequence 1 itself arrived through it, step 2 is
//! skipped: every later item of the run is published after that one, so live items and the
//! ledger (for gaps, step 3) cover the rest, and the first item goes out without a ledger read.
//! Step 2 is skipped too when the timer found the event dispatched before any item of its
//! run arrived (a busy host): the registration has then provably missed nothing of the run
//! (no lag, nothing dropped that could be the run's), so the run is streamed live from its
//! first item.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use sb_common::retry::RetryPolicy;
use sb_protocol::error::ErrorCode;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::messages::LiveItem;
use sb_protocol::result::AgentRunResult;
use sb_store::events::{EventLog, EventStatus};
use sb_store::runs::{RunEventRecord, RunLedger, RunRecord};
use serde_json::{Map, Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::limits::StreamSlot;
use crate::live::{Drained, LiveHub, Watch};

/// Tuning of result streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOptions {
    /// Interval of keep-alive comments on an idle stream (below common proxy idle timeouts).
    pub keep_alive: Duration,
    /// Read the ledger when no live item arrived for this long (safety net, see module docs).
    pub ledger_poll: Duration,
    /// Items read from the ledger per query.
    pub page_size: u64,
    /// How long `POST /v1/events?stream=true` waits for the event to be routed.
    pub route_wait: Duration,
    /// First interval of the timer that re-reads an event's routing state while
    /// `?stream=true` waits, unless runs' first items typically take longer (then twice
    /// that); doubled after each tick, up to `route_poll_max` (see [`route_poll_delay`]).
    /// The live items of the conversation wake the wait and find a dispatched event's route;
    /// the timer covers events that produce no item (unrouted, rejected, scheduled) and live
    /// items lost with a broker connection.
    pub route_poll_min: Duration,
    /// Longest interval of that timer.
    pub route_poll_max: Duration,
    /// Frames buffered between the stream task and the HTTP connection.
    pub buffer: usize,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            keep_alive: Duration::from_secs(15),
            ledger_poll: Duration::from_secs(5),
            page_size: 500,
            route_wait: Duration::from_secs(30),
            // The run's first live item finds a dispatched route (an idle host streams it
            // within milliseconds), so the timer only has to report events that produce no
            // item: unrouted or rejected within a tenth of a second of being routed, without
            // reading the event log several times for every run that streams.
            route_poll_min: Duration::from_millis(100),
            // Bounds how late a route whose live items were lost is found, at about one read
            // a second while a route is slow.
            route_poll_max: Duration::from_secs(1),
            buffer: 64,
        }
    }
}

/// What a stream task needs.
#[derive(Clone)]
pub struct StreamContext {
    /// The ledger (source of truth).
    pub runs: Arc<dyn RunLedger>,
    /// The event log (routing status of `?stream=true` ingests).
    pub events: Arc<dyn EventLog>,
    /// Live items.
    pub live: LiveHub,
    /// How long this process's `?stream=true` requests wait for their run's first item.
    pub route_pace: RoutePace,
    /// Tuning.
    pub options: StreamOptions,
    /// Process shutdown: ends every stream, so the graceful shutdown of the HTTP server
    /// is not held up by open streams.
    pub shutdown: CancellationToken,
}

/// Frame for one result item: `id` = sequence, `event` = result type, `data` = the item.
pub fn result_frame(result: &AgentRunResult) -> Event {
    let sequence = result.sequence.unwrap_or_default();
    let data = serde_json::to_string(result).unwrap_or_else(|_| "{}".to_owned());
    frame(sequence, &result.result_type, &data)
}

/// Frame of a live item whose result names its run and sequence: its JSON as delivered is
/// the `data` ([`result_frame`] of the parsed result would write the same text, as the
/// delivery's producer serialized the same result).
pub fn live_frame(item: &LiveItem) -> Event {
    frame(item.sequence, &item.result_type, item.result.get())
}

fn frame(sequence: u64, result_type: &str, data: &str) -> Event {
    Event::default()
        .id(sequence.to_string())
        .event(frame_event_name(result_type))
        .data(data)
}

/// The `event:` name of a result type. Types are validated by the worker; this only keeps
/// a corrupt row from breaking the framing (a line break would end the field).
pub(crate) fn frame_event_name(result_type: &str) -> String {
    let name: String = result_type
        .chars()
        .filter(|c| !matches!(c, '\r' | '\n'))
        .collect();
    if name.is_empty() {
        "message".to_owned()
    } else {
        name
    }
}

/// Frame ending a stream early: `event: error`, `data: {code, message, …extra}`.
pub fn error_frame(code: ErrorCode, message: &str, extra: Map<String, Value>) -> Event {
    let mut body = Map::new();
    body.insert("code".into(), json!(code));
    body.insert("message".into(), json!(message));
    body.extend(extra);
    Event::default()
        .event("error")
        .data(Value::Object(body).to_string())
}

/// The API item of a ledger row: the stored result, with `run_id` and `sequence` from the
/// row (the ledger key is authoritative).
pub fn record_to_result(record: &RunEventRecord) -> AgentRunResult {
    let parsed = match &record.data {
        Value::Object(map) if map.contains_key("type") => {
            serde_json::from_value::<AgentRunResult>(record.data.clone()).ok()
        }
        _ => None,
    };
    let mut result = parsed.unwrap_or_else(|| AgentRunResult {
        run_id: String::new(),
        result_type: record.result_type.clone(),
        data: match &record.data {
            Value::Object(map) => map.clone(),
            _ => Map::new(),
        },
        sequence: None,
        timestamp: Some(record.created_at.timestamp()),
        usage: None,
    });
    result.run_id = record.run_id.to_string();
    result.result_type.clone_from(&record.result_type);
    result.sequence = u64::try_from(record.sequence).ok();
    result
}

/// An SSE response fed by a stream task through a bounded channel. The task sees
/// `tx.closed()` when the client goes away. The caller's stream slot lives in the body: it
/// is given back when the body is dropped, after the last frame or when the client left.
pub(crate) fn sse_from(
    rx: mpsc::Receiver<Event>,
    keep_alive: Duration,
    slot: StreamSlot,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let frames = ReceiverStream::new(rx).map(move |frame| {
        let _held = &slot;
        Ok::<_, Infallible>(frame)
    });
    Sse::new(frames).keep_alive(KeepAlive::new().interval(keep_alive))
}

/// The SSE response of `GET /v1/runs/{id}/stream`: results of `run_id` after `after`.
/// The caller has checked that the run exists and belongs to the caller's workspace, and
/// took the key's stream `slot`.
pub fn run_stream(
    ctx: StreamContext,
    run_id: RunId,
    after: u64,
    slot: StreamSlot,
) -> impl axum::response::IntoResponse {
    let (tx, rx) = mpsc::channel(ctx.options.buffer.max(1));
    let keep_alive = ctx.options.keep_alive;
    tokio::spawn(async move {
        let mut pump = Pump {
            ctx: &ctx,
            run_id,
            last: after,
            tx: &tx,
            terminal: false,
            hole_since: None,
        };
        let outcome = pump_run(&mut pump).await;
        if let Err(end) = outcome {
            send_end(&tx, end).await;
        }
    });
    sse_from(rx, keep_alive, slot)
}

/// How `POST /v1/events?stream=true` learns which run handles its event.
pub struct PendingRoute {
    /// The event.
    pub event_id: EventId,
    /// Its workspace.
    pub workspace: WorkspaceId,
    /// Its conversation.
    pub conversation: Option<String>,
    /// The registration for the event's conversation ([`LiveHub::watch_conversation`]),
    /// made before the event was committed; `None` when the bus could not bind it then (the
    /// event is accepted all the same: the stream task tries again).
    pub watch: Option<Watch>,
    /// This request created the event (not the answer to a repeated idempotency key).
    pub created: bool,
}

/// The SSE response of `POST /v1/events?stream=true`: waits until the event is routed,
/// then streams the run that handles it. The caller took the key's stream `slot`.
pub fn event_stream(
    ctx: StreamContext,
    pending: PendingRoute,
    slot: StreamSlot,
) -> impl axum::response::IntoResponse {
    let (tx, rx) = mpsc::channel(ctx.options.buffer.max(1));
    let keep_alive = ctx.options.keep_alive;
    tokio::spawn(async move {
        let outcome = wait_for_route(&ctx, pending, &tx).await;
        match outcome {
            Ok(Some(route)) => {
                let mut pump = Pump {
                    ctx: &ctx,
                    run_id: route.run_id,
                    last: route.after,
                    tx: &tx,
                    terminal: false,
                    hole_since: None,
                };
                let bound = Bound {
                    watch: route.watch,
                    head: route.head,
                    complete: route.complete,
                };
                let outcome = pump_run_with(&mut pump, Some(bound)).await;
                if let Err(end) = outcome {
                    send_end(&tx, end).await;
                }
            }
            Ok(None) => {}
            Err(end) => send_end(&tx, end).await,
        }
    });
    sse_from(rx, keep_alive, slot)
}

/// Why a stream task stopped before the terminal item.
#[derive(Debug)]
enum End {
    /// The client went away, or the process is shutting down: nothing to send.
    Quiet,
    /// Tell the client, then close.
    Error {
        code: ErrorCode,
        message: String,
        extra: Map<String, Value>,
    },
}

impl From<ApiError> for End {
    fn from(err: ApiError) -> Self {
        Self::Error {
            code: err.code(),
            message: err.message().to_owned(),
            extra: Map::new(),
        }
    }
}

impl From<sb_store::StoreError> for End {
    fn from(err: sb_store::StoreError) -> Self {
        let api = ApiError::from_coded(&err);
        if api.code() == ErrorCode::Internal || api.code() == ErrorCode::Unavailable {
            tracing::warn!(error = %err, "result stream stopped by a store error");
        }
        api.into()
    }
}

impl From<sb_common::bus::BusError> for End {
    fn from(err: sb_common::bus::BusError) -> Self {
        tracing::warn!(error = %err, "result stream cannot register for live items");
        ApiError::from_coded(&err).into()
    }
}

/// How long a stream waits for a hole in a run's ledger to fill before it skips it (see the
/// module docs). Requeued items come back within the sink's retry delay; this is far longer.
pub const HOLE_PATIENCE: Duration = Duration::from_secs(30);

/// How many of `sequences` (ascending, each after `last`) may be sent after `last` now: the
/// run of consecutive sequences `last + 1, last + 2, …` at their start.
#[must_use]
pub fn dense_prefix(last: u64, sequences: impl IntoIterator<Item = u64>) -> usize {
    (last + 1..)
        .zip(sequences)
        .take_while(|(expected, sequence)| expected == sequence)
        .count()
}

struct Pump<'a> {
    ctx: &'a StreamContext,
    run_id: RunId,
    /// Last sequence sent (or skipped at the client's request).
    last: u64,
    tx: &'a mpsc::Sender<Event>,
    /// The terminal item was sent.
    terminal: bool,
    /// Since when the ledger has shown a hole right after `last` (items after it are stored,
    /// `last + 1` is not yet).
    hole_since: Option<tokio::time::Instant>,
}

impl Pump<'_> {
    async fn send(&mut self, result: &AgentRunResult) -> Result<(), End> {
        self.send_frame(result_frame(result), result.sequence, result.is_terminal())
            .await
    }

    /// Sends `frame`, the item at `sequence` (`None`: unnumbered, `last` stays).
    async fn send_frame(
        &mut self,
        frame: Event,
        sequence: Option<u64>,
        terminal: bool,
    ) -> Result<(), End> {
        tokio::select! {
            biased;
            () = self.ctx.shutdown.cancelled() => return Err(End::Quiet),
            sent = self.tx.send(frame) => sent.map_err(|_| End::Quiet)?,
        }
        self.last = sequence.unwrap_or(self.last);
        self.terminal = terminal;
        Ok(())
    }

    /// Sends the ledger items that continue `last` without a hole. Stops at a terminal item,
    /// and at a hole younger than [`HOLE_PATIENCE`].
    async fn catch_up(&mut self) -> Result<(), End> {
        let page = self.ctx.options.page_size.max(1);
        loop {
            let after = i64::try_from(self.last).unwrap_or(i64::MAX);
            let records = self.ctx.runs.events_after(self.run_id, after, page).await?;
            let count = records.len() as u64;
            let records: Vec<_> = records
                .iter()
                .filter(|r| u64::try_from(r.sequence).is_ok_and(|s| s > self.last))
                .collect();
            let sequences = records
                .iter()
                .map(|r| u64::try_from(r.sequence).unwrap_or_default());
            let mut sendable = dense_prefix(self.last, sequences);
            if sendable == 0 && !records.is_empty() {
                let since = *self
                    .hole_since
                    .get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() < HOLE_PATIENCE {
                    return Ok(());
                }
                tracing::warn!(run_id = %self.run_id, after = self.last, next = records[0].sequence, "a hole in the run's ledger did not fill; skipping it");
                sendable = records.len();
            }
            if sendable > 0 {
                self.hole_since = None;
            }
            for record in &records[..sendable] {
                self.send(&record_to_result(record)).await?;
                if self.terminal {
                    return Ok(());
                }
            }
            if sendable < records.len() || count < page {
                return Ok(());
            }
        }
    }

    /// Step 3 for one live item: drops it if already sent, sends it if it continues `last`,
    /// and reads the ledger for the items in between if it is further ahead. `false` if it
    /// was dropped (another run's item, or already sent): no progress.
    async fn on_live(&mut self, item: &LiveItem) -> Result<bool, End> {
        if item.run_id != self.run_id || item.sequence <= self.last {
            return Ok(false);
        }
        if item.sequence == self.last + 1 {
            // Sent as delivered when its result names its run and sequence already (every
            // item a worker numbered does): neither parsed nor serialized again.
            if item.names_itself {
                self.send_frame(live_frame(item), Some(item.sequence), item.is_terminal())
                    .await?;
            } else {
                let result = item
                    .to_result()
                    .with_run_id(item.run_id)
                    .with_sequence(item.sequence);
                self.send(&result).await?;
            }
        } else {
            self.catch_up().await?;
        }
        Ok(true)
    }

    /// Reads the run's status, then the ledger. A run that ended while its terminal item is
    /// not in the ledger (after the status was read, so after the item would have been
    /// stored) has lost its results to retention: say so and stop. Returns the run as read.
    async fn catch_up_checked(&mut self) -> Result<Option<RunRecord>, End> {
        let run = self.ctx.runs.get_run(self.run_id).await?;
        self.catch_up().await?;
        if self.terminal {
            return Ok(run);
        }
        match &run {
            None => Err(End::Error {
                code: ErrorCode::NotFound,
                message: format!("run {} not found", self.run_id),
                extra: Map::new(),
            }),
            // Waiting for a hole to fill: the items after it are stored, so nothing expired.
            Some(_) if self.hole_since.is_some() => Ok(run),
            Some(run) if run.status.is_terminal() => {
                let mut extra = Map::new();
                extra.insert("status".into(), json!(run.status));
                extra.insert("last_sequence".into(), json!(run.last_sequence));
                Err(End::Error {
                    code: ErrorCode::NotFound,
                    message: format!(
                        "run {} ended ({}) and its results after sequence {} are no longer stored",
                        self.run_id, run.status, self.last
                    ),
                    extra,
                })
            }
            Some(_) => Ok(run),
        }
    }
}

/// Sends the error frame of `end`, if it has one.
async fn send_end(tx: &mpsc::Sender<Event>, end: End) {
    if let End::Error {
        code,
        message,
        extra,
    } = end
    {
        let _ = tx.send(error_frame(code, &message, extra)).await;
    }
}

async fn pump_run(p: &mut Pump<'_>) -> Result<(), End> {
    pump_run_with(p, None).await
}

/// Step 1 of [`pump_run`], done by the caller ([`wait_for_route`]).
struct Bound {
    /// A watch bound before anything of the run was persisted.
    watch: Watch,
    /// Items it received in its last wake-up, in order and without a gap.
    head: Vec<Arc<LiveItem>>,
    /// The watch has received every item of the run published so far: it was bound
    /// before the run's event was committed, and it dropped nothing that could have been
    /// the run's (see [`wait_for_route`]).
    complete: bool,
}

/// [`pump_run`] with step 1 already done by the caller, if `bound` is given. When its items
/// include the run's item after `last`, or when the watch missed nothing of the run, step 2
/// is skipped: every later item of the run is published after those, so it reaches the
/// watch as well (the ledger poll of step 3 stays the safety net for a lost delivery).
async fn pump_run_with(p: &mut Pump<'_>, bound: Option<Bound>) -> Result<(), End> {
    // 1. Bind first.
    let (mut watch, head, complete) = match bound {
        Some(bound) => (bound.watch, bound.head, bound.complete),
        None => (p.ctx.live.watch(p.run_id).await?, Vec::new(), false),
    };
    let continues_live = (complete && p.last == 0)
        || head
            .iter()
            .any(|m| m.run_id == p.run_id && m.sequence == p.last + 1);
    if continues_live {
        for message in &head {
            p.on_live(message).await?;
            if p.terminal {
                return Ok(());
            }
        }
    } else {
        // 2. Then the ledger.
        let run = p.catch_up_checked().await?;
        if p.terminal {
            return Ok(());
        }
        let uncovered = run.is_some_and(|run| {
            !watch.covers(
                run.id,
                run.workspace_id.as_str(),
                run.conversation_id.as_deref(),
            )
        });
        if uncovered {
            // The run's items are not routed to the watched conversation (cannot happen
            // while runs keep their event's conversation): bind the run itself, then read the
            // ledger again.
            watch = p.ctx.live.watch(p.run_id).await?;
            p.catch_up().await?;
            if p.terminal {
                return Ok(());
            }
        }
    }
    // 3. Then live items, with the ledger as the gap filler and safety net.
    let mut live = true;
    let mut poll_at = tokio::time::Instant::now() + p.ctx.options.ledger_poll;
    loop {
        // Items of other runs (of a watched conversation) do not count as progress.
        let poll = tokio::time::sleep_until(poll_at);
        tokio::select! {
            biased;
            () = p.ctx.shutdown.cancelled() => return Err(End::Quiet),
            () = p.tx.closed() => return Err(End::Quiet),
            item = watch.recv(), if live => match item {
                Ok(message) => {
                    if !p.on_live(&message).await? {
                        continue;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(skipped)) => {
                    tracing::debug!(run_id = %p.run_id, skipped, "live stream lagged; reading the ledger");
                    p.catch_up().await?;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    // The hub stopped: keep going on ledger polls alone.
                    live = false;
                }
            },
            () = poll => {
                p.catch_up_checked().await?;
            }
        }
        if p.terminal {
            return Ok(());
        }
        poll_at = tokio::time::Instant::now() + p.ctx.options.ledger_poll;
    }
}

/// The wait before the timer of `POST /v1/events?stream=true` reads the event's routing
/// state again, after `ticks` earlier timer reads: at first `route_poll_min` or twice the
/// `typical` wait for a run's first item ([`RoutePace`]), whichever is longer, doubled per
/// tick, at most `route_poll_max`. Live items of the conversation trigger reads of their own.
///
/// Why the typical wait: the timer is there for events that produce no live item
/// (unrouted, rejected, scheduled), and a read before a routed event's first item could
/// arrive finds it still `received`. On a busy host every run's first item takes longer
/// than `route_poll_min` (a quarter of a second at 64 runs in flight), and a fixed first
/// tick read the event log once for nearly every run that streamed; now the first tick
/// comes when a routed event's item would have arrived, and an unrouted event is reported
/// in about twice the time routing takes everyone else.
#[must_use]
pub fn route_poll_delay(options: &StreamOptions, ticks: u32, typical: Duration) -> Duration {
    let first = options
        .route_poll_min
        .max(typical.saturating_mul(2))
        .min(options.route_poll_max);
    RetryPolicy::new(first, options.route_poll_max).delay(ticks)
}

/// A moving average of how long `?stream=true` requests waited for their run's first live
/// item, shared by the streams of one process (see [`route_poll_delay`]). Only routes found
/// by a live item are counted: a route found by a timer read measures the timer, and
/// counting it would stretch the timer further. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct RoutePace {
    /// The average, in microseconds.
    micros: Arc<std::sync::atomic::AtomicU64>,
}

impl RoutePace {
    /// The typical wait so far (zero before the first).
    #[must_use]
    pub fn typical(&self) -> Duration {
        Duration::from_micros(self.micros.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Counts one wait: the average moves an eighth of the way towards it.
    pub fn observe(&self, waited: Duration) {
        let sample = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        // A lost race drops one sample of an average; no need to retry.
        let _ = self.micros.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |average| Some(moved(average, sample)),
        );
    }
}

/// `average` moved an eighth of the way towards `sample`.
fn moved(average: u64, sample: u64) -> u64 {
    if sample >= average {
        average + (sample - average) / 8
    } else {
        average - (average - sample) / 8
    }
}

/// Where the stream of a `?stream=true` event goes once the event is routed.
struct Route {
    /// The run handling the event.
    run_id: RunId,
    /// The sequence to stream after.
    after: u64,
    /// The conversation's registration, bound before the run existed.
    watch: Watch,
    /// The items the watch received in its last wake-up, in order (see [`pump_run_with`]).
    head: Vec<Arc<LiveItem>>,
    /// See [`Bound::complete`].
    complete: bool,
}

/// Waits until the event is routed, woken by the live items of the event's conversation
/// (`pending.watch`) and, as a safety net, by a sparse timer ([`route_poll_delay`]). An item
/// that names the event as its run's trigger is the route itself; any other wake-up reads
/// the event's routing state. Returns the run to stream, or `Ok(None)` when the client left.
///
/// A watch bound before the event was committed has seen every item of the event's run,
/// unless it lagged or this loop dropped an item that does not name its trigger (an older
/// host's): while neither happened, a route read from the ledger is streamed live from its
/// first item without reading the ledger ([`Bound::complete`]).
async fn wait_for_route(
    ctx: &StreamContext,
    pending: PendingRoute,
    tx: &mpsc::Sender<Event>,
) -> Result<Option<Route>, End> {
    let PendingRoute {
        event_id,
        workspace,
        conversation,
        watch,
        created,
    } = pending;
    // The first read of the route is skipped when the watch was in place before this
    // request committed the event: it cannot have been routed before, and every item of its
    // run reaches the watch.
    let (mut watch, mut read, mut complete) = match watch {
        Some(watch) if watch.covers_conversation(workspace.as_str(), conversation.as_deref()) => {
            (watch, !created, created)
        }
        _ => {
            let watch = ctx
                .live
                .watch_conversation(workspace.as_str(), conversation.as_deref())
                .await?;
            (watch, true, false)
        }
    };
    let started = tokio::time::Instant::now();
    let deadline = started + ctx.options.route_wait;
    let mut ticks = 0;
    let mut live = true;
    let mut head: Vec<Arc<LiveItem>> = Vec::new();
    loop {
        if let Some(run_id) = own_run(&head, event_id) {
            ctx.route_pace.observe(started.elapsed());
            return Ok(Some(Route {
                run_id,
                after: 0,
                watch,
                head,
                complete: false,
            }));
        }
        if read {
            if let Some((run_id, after, dispatched)) = read_route(ctx, event_id).await? {
                // A run that absorbed the event as steering input streamed items before the
                // watch was bound; the head may hold items that do not name their trigger.
                let complete = complete && dispatched && head.iter().all(|m| m.event_id.is_some());
                return Ok(Some(Route {
                    run_id,
                    after,
                    watch,
                    head,
                    complete,
                }));
            }
        }
        read = true;
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(End::Error {
                code: ErrorCode::DeadlineExceeded,
                message: format!(
                    "event {event_id} was not routed within {:?}",
                    ctx.options.route_wait
                ),
                extra: route_extra(event_id, EventStatus::Received, None),
            });
        }
        tokio::select! {
            biased;
            () = ctx.shutdown.cancelled() => return Ok(None),
            () = tx.closed() => return Ok(None),
            item = watch.recv(), if live => {
                // Something happened in the conversation: look again, once for everything
                // that arrived meanwhile (kept: it may be the run's first item). An item
                // dropped here is provably another run's only if it names its trigger.
                complete &= head.iter().all(|m| m.event_id.is_some());
                head.clear();
                live = match item {
                    Ok(message) => {
                        head.push(message);
                        true
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        complete = false;
                        true
                    }
                    Err(broadcast::error::RecvError::Closed) => false,
                };
                if live {
                    let drained = watch.drain_into(&mut head);
                    live = drained != Drained::Closed;
                    complete &= drained == Drained::Complete;
                } else {
                    complete = false;
                }
            }
            () = tokio::time::sleep(
                route_poll_delay(&ctx.options, ticks, ctx.route_pace.typical()).min(deadline - now)
            ) => {
                ticks = ticks.saturating_add(1);
            }
        }
    }
}

/// The run of `event_id` among live items that name their run's trigger.
fn own_run(items: &[Arc<LiveItem>], event_id: EventId) -> Option<RunId> {
    items
        .iter()
        .find(|m| m.event_id == Some(event_id))
        .map(|m| m.run_id)
}

/// The `extra` fields of a routing error frame.
fn route_extra(event_id: EventId, status: EventStatus, reason: Option<&str>) -> Map<String, Value> {
    let mut extra = Map::new();
    extra.insert("event_id".into(), json!(event_id));
    extra.insert("status".into(), json!(status));
    if let Some(reason) = reason {
        extra.insert("reason".into(), json!(reason));
    }
    extra
}

/// Reads the event's routing state: the run to stream, the sequence to stream after and
/// whether the run is the event's own (`dispatched`, not a run it steers) once routed,
/// `None` while it is not, or the error that ends the stream.
async fn read_route(
    ctx: &StreamContext,
    event_id: EventId,
) -> Result<Option<(RunId, u64, bool)>, End> {
    let Some(event) = ctx.events.routing(event_id).await? else {
        return Err(End::Error {
            code: ErrorCode::NotFound,
            message: format!("event {event_id} not found"),
            extra: Map::new(),
        });
    };
    let extra = route_extra(event_id, event.status, event.reason.as_deref());
    match event.status {
        EventStatus::Dispatched => Ok(event.run_id.map(|run_id| (run_id, 0, true))),
        EventStatus::Claimed => match event.claimed_by_run_id.or(event.run_id) {
            Some(run_id) => {
                // The message steers a run that already streamed earlier items; the reply to
                // this message is what that run produces from now on.
                let after = ctx
                    .runs
                    .get_run(run_id)
                    .await?
                    .map_or(0, |r| u64::try_from(r.last_sequence).unwrap_or(0));
                Ok(Some((run_id, after, false)))
            }
            None => Ok(None),
        },
        EventStatus::Unrouted => {
            let reason = event.reason.as_deref().unwrap_or("no agent handles it");
            Err(End::Error {
                code: ErrorCode::NotFound,
                message: format!("event {event_id} was not routed: {reason}"),
                extra,
            })
        }
        EventStatus::Rejected => {
            let reason = event
                .reason
                .as_deref()
                .unwrap_or("rejected by the agent's concurrency policy");
            Err(End::Error {
                code: ErrorCode::Conflict,
                message: format!("event {event_id} was rejected: {reason}"),
                extra,
            })
        }
        EventStatus::Scheduled => Err(End::Error {
            code: ErrorCode::InvalidArgument,
            message: format!(
                "event {event_id} is scheduled for later delivery; stream its run later"
            ),
            extra,
        }),
        EventStatus::Received => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{
        RoutePace, StreamOptions, dense_prefix, live_frame, moved, result_frame, route_poll_delay,
    };
    use serde_json::json;

    #[test]
    fn the_route_timer_starts_late_and_backs_off_to_a_read_a_second() {
        let options = StreamOptions::default();
        let schedule = |typical: Duration| -> Vec<u64> {
            (0..7)
                .map(|ticks| {
                    u64::try_from(route_poll_delay(&options, ticks, typical).as_millis())
                        .unwrap_or(u64::MAX)
                })
                .collect()
        };
        // An idle host: after the read at once, reads at 100, 300, 700, 1500, 2500, … ms.
        assert_eq!(
            schedule(Duration::ZERO),
            [100, 200, 400, 800, 1000, 1000, 1000]
        );
        assert_eq!(
            schedule(Duration::from_millis(5)),
            [100, 200, 400, 800, 1000, 1000, 1000]
        );
        // A busy host whose runs' first items take a quarter of a second: the first tick
        // waits for twice that; never longer than the longest interval.
        assert_eq!(
            schedule(Duration::from_millis(250)),
            [500, 1000, 1000, 1000, 1000, 1000, 1000]
        );
        assert_eq!(schedule(Duration::from_secs(5)), [1000; 7]);
        // No overflow far out.
        assert_eq!(
            route_poll_delay(&options, u32::MAX, Duration::MAX),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_route_pace_follows_the_waits_it_counts() {
        let pace = RoutePace::default();
        assert_eq!(pace.typical(), Duration::ZERO);
        for _ in 0..64 {
            pace.observe(Duration::from_millis(240));
        }
        let busy = pace.typical();
        assert!(
            busy > Duration::from_millis(235) && busy <= Duration::from_millis(240),
            "{busy:?}"
        );
        for _ in 0..64 {
            pace.observe(Duration::from_millis(2));
        }
        assert!(
            pace.typical() < Duration::from_millis(5),
            "{:?}",
            pace.typical()
        );
        // The extremes neither overflow nor underflow.
        assert_eq!(moved(u64::MAX, u64::MAX), u64::MAX);
        assert_eq!(moved(0, 0), 0);
        assert_eq!(moved(8, 0), 7);
    }

    #[test]
    fn a_live_item_naming_the_event_is_its_route() {
        use std::sync::Arc;

        use sb_protocol::ids::{EventId, RunId, WorkspaceId};
        use sb_protocol::messages::{LiveItem, ResultMessage};
        use sb_protocol::result::AgentRunResult;

        let item = |run_id: RunId, event_id: Option<EventId>| {
            let result = AgentRunResult::run_failed("x", "y", false);
            let message = ResultMessage::new(
                run_id,
                WorkspaceId::default_workspace(),
                Some("c".into()),
                1,
                result,
            );
            let json = serde_json::value::to_raw_value(&message.result).unwrap();
            Arc::new(LiveItem::new(run_id, event_id, 1, json).unwrap())
        };
        let (ours, other_event) = (EventId::new(), EventId::new());
        let (run, other_run) = (RunId::new(), RunId::new());
        // Another run of the conversation, or an item of an older host (no event id): not
        // the route, the state must be read.
        let head = vec![item(other_run, Some(other_event)), item(other_run, None)];
        assert_eq!(super::own_run(&head, ours), None);
        let head = vec![item(other_run, Some(other_event)), item(run, Some(ours))];
        assert_eq!(super::own_run(&head, ours), Some(run));
    }

    #[test]
    fn a_live_item_is_framed_as_its_parsed_result_would_be() {
        use sb_protocol::ids::RunId;
        use sb_protocol::messages::LiveItem;
        use sb_protocol::result::AgentRunResult;

        let run = RunId::new();
        let result: AgentRunResult = serde_json::from_value(json!({
            "type": "message.delta",
            "data": {"chunk": {"role": "assistant", "content": "a \"b\"\nc"}},
        }))
        .unwrap();
        let result = result.with_run_id(run).with_sequence(3);
        let json = serde_json::value::to_raw_value(&result).unwrap();
        let item = LiveItem::new(run, None, 3, json).unwrap();
        assert!(item.names_itself);
        // The event's wire text: id, event name and data as the ledger path writes them.
        assert_eq!(
            format!("{:?}", live_frame(&item)),
            format!("{:?}", result_frame(&result))
        );
    }

    #[test]
    fn only_what_continues_the_last_sequence_without_a_hole_is_sendable() {
        assert_eq!(dense_prefix(0, [1, 2, 3]), 3);
        assert_eq!(dense_prefix(156, [157, 158]), 2);
        // 157 not stored yet (requeued behind 158 during an outage): nothing is sendable.
        assert_eq!(dense_prefix(156, [158, 159]), 0);
        assert_eq!(dense_prefix(156, [157, 159, 160]), 1);
        assert_eq!(dense_prefix(3, []), 0);
    }
}
