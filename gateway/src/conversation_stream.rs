//! The server-sent event stream of a whole conversation, `GET /v1/conversations/{id}/stream`
//! (SPEC §10.1): the result items of every run of the conversation, each tagged with its
//! `run_id` and `sequence`, ledger first and then live, with no gap and no duplicate, and
//! resumable.
//!
//! Frames are those of a run stream (`event: <result type>`, `data: <AgentRunResult>`), with
//! a conversation-level position as `id:`.
//!
//! # The position (`Last-Event-ID`)
//!
//! Runs of one conversation overlap (the default concurrency policy is `parallel`), so no
//! single `(run, sequence)` says what a client has seen. The position is a
//! [`ConversationCursor`]: a time `since` and the last sequence sent of every run created at
//! or after it,
//!
//! ```text
//! c1.<since, epoch ms>.<run_id>:<sequence>.<run_id>:<sequence>…
//!
//!   runs by created_at:   A(done)   B(open, 4 sent)   C(done, 7 sent)   D(open, 0 sent)
//!                                   ^ since = the oldest run still open
//!   cursor:               c1.<B.created_at>.B:4.C:7.D:0
//! ```
//!
//! where `since` is the creation time of the oldest run still open in the stream (or, when
//! none is open, of the newest run it knows, or the start time). A run created before
//! `since` that the cursor does not list was finished; a listed run resumes after its
//! sequence; a run created at or after `since` that it does not list is new and is streamed
//! from its first item. The cursor stays short: it lists only the runs since the oldest open
//! one. It relies on a conversation's runs being created in `created_at` order, which holds
//! because the events of one conversation are routed one at a time by one shard consumer.
//!
//! # The algorithm
//!
//! 1. register for the live items of the whole conversation
//!    ([`LiveHub::watch_conversation`](crate::live::LiveHub::watch_conversation): the
//!    binding is on the broker when it returns);
//! 2. list the conversation's runs created at or after `since` and, for each, read the
//!    ledger after its position and send it;
//! 3. then for each live item: a run not known yet makes the runs be listed again, so every
//!    run created before it is known too (the cursor's `since` counts known runs only), and
//!    is added (its ledger is read from the start); an item at or below the run's position
//!    is dropped, the next one is sent, one further ahead makes the run's ledger be read
//!    again (it has the missing items, since items are published live only after they
//!    are persisted);
//! 4. every `ledger_poll` without progress, list the runs again and read the ledger of the
//!    open ones: a safety net for live items lost with a broker connection.
//!
//! Step 1 before step 2 makes it gap-free, as for one run. Unlike a run stream it has no
//! end: it runs until the client leaves (or the process shuts down), with keep-alives.
//!
//! Without a cursor the stream starts with the conversation's runs that are still active
//! (from their first item) and every later run; `?since=<epoch ms>` starts instead with
//! every run created from that time on, finished ones included.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use axum::response::sse::Event;
use chrono::{DateTime, Utc};
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::result::AgentRunResult;
use sb_store::runs::{RunFilter, RunRecord};
use tokio::sync::{broadcast, mpsc};

use crate::limits::StreamSlot;
use crate::live::Watch;
use crate::stream::{StreamContext, frame_event_name, record_to_result, sse_from};

/// Version tag of the cursor form.
const CURSOR_TAG: &str = "c1";
/// Most runs a cursor may list (a longer one is refused rather than parsed).
pub const MAX_CURSOR_RUNS: usize = 256;
/// Runs listed per page when looking for the conversation's runs.
const RUN_PAGE: i64 = 100;

/// A position in a conversation's stream (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversationCursor {
    /// Runs created before this time (epoch ms) and not listed are finished.
    pub since_ms: i64,
    /// The last sequence sent of each listed run.
    pub runs: Vec<(RunId, u64)>,
}

/// Why a cursor does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid conversation stream position: {0}")]
pub struct CursorError(String);

impl fmt::Display for ConversationCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{CURSOR_TAG}.{}", self.since_ms)?;
        for (run_id, sequence) in &self.runs {
            write!(f, ".{run_id}:{sequence}")?;
        }
        Ok(())
    }
}

impl FromStr for ConversationCursor {
    type Err = CursorError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| CursorError(why.to_owned());
        let mut parts = s.trim().split('.');
        if parts.next() != Some(CURSOR_TAG) {
            return Err(bad(
                "expected the `id` of a conversation stream frame (c1.…)",
            ));
        }
        let since_ms = parts
            .next()
            .and_then(|p| p.parse::<i64>().ok())
            .filter(|ms| *ms >= 0)
            .ok_or_else(|| bad("expected a time in epoch milliseconds after `c1.`"))?;
        let mut runs = Vec::new();
        for part in parts {
            if runs.len() == MAX_CURSOR_RUNS {
                return Err(bad("too many runs"));
            }
            let (run, sequence) = part
                .split_once(':')
                .ok_or_else(|| bad("expected <run_id>:<sequence>"))?;
            let run_id: RunId = run.parse().map_err(|_| bad("expected a run id"))?;
            let sequence: u64 = sequence.parse().map_err(|_| bad("expected a sequence"))?;
            runs.push((run_id, sequence));
        }
        Ok(Self { since_ms, runs })
    }
}

/// Where one run stands in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RunPosition {
    /// The run's `created_at`, epoch ms.
    created_ms: i64,
    /// Last sequence sent (or skipped because it was sent before a resume).
    last: u64,
    /// Its terminal item was sent, or it ended before the stream needed it.
    done: bool,
}

/// The stream's positions: pure bookkeeping, from which the cursor of every frame follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Positions {
    /// The floor when no run is known.
    start_ms: i64,
    runs: BTreeMap<RunId, RunPosition>,
}

/// What to do with a run found when (re)starting the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Stream it after this sequence.
    After(u64),
    /// Leave it out: it was finished before the stream's start (at this last sequence,
    /// which the cursor keeps so that a resume leaves it out too).
    Finished(u64),
}

impl Positions {
    /// Positions starting at `start_ms` with nothing known.
    #[must_use]
    pub fn new(start_ms: i64) -> Self {
        Self {
            start_ms,
            runs: BTreeMap::new(),
        }
    }

    /// Positions resuming from `cursor`: its runs are known at their sequence.
    #[must_use]
    pub fn resume(cursor: &ConversationCursor) -> Self {
        let mut positions = Self::new(cursor.since_ms);
        for (run_id, last) in &cursor.runs {
            positions.runs.insert(
                *run_id,
                RunPosition {
                    created_ms: cursor.since_ms,
                    last: *last,
                    done: false,
                },
            );
        }
        positions
    }

    /// Whether `run_id` is known.
    #[must_use]
    pub fn knows(&self, run_id: RunId) -> bool {
        self.runs.contains_key(&run_id)
    }

    /// The floor of the current position: runs created before it and not known are
    /// finished.
    #[must_use]
    pub fn since_ms(&self) -> i64 {
        let open = self
            .runs
            .values()
            .filter(|r| !r.done)
            .map(|r| r.created_ms)
            .min();
        let newest = self.runs.values().map(|r| r.created_ms).max();
        open.or(newest).unwrap_or(self.start_ms)
    }

    /// The decision for a run found in the store, created at `created_ms`, that has ended
    /// at sequence `ended_at` (`None`: still active): a known run keeps its position; an
    /// unknown one created before the floor was finished; otherwise it is streamed from its
    /// start, unless it has ended and was created before `skip_finished_before` (a fresh
    /// stream, opened then, leaves out what ended before it began). A run created after the
    /// stream was asked for is streamed whole even if it ended before the first listing: its
    /// items can all arrive between the response's headers and the live binding.
    #[must_use]
    pub fn admit(
        &self,
        run_id: RunId,
        created_ms: i64,
        ended_at: Option<u64>,
        skip_finished_before: Option<i64>,
    ) -> Admit {
        match (self.runs.get(&run_id), ended_at) {
            (Some(known), _) => Admit::After(known.last),
            (None, ended) if created_ms < self.start_ms => Admit::Finished(ended.unwrap_or(0)),
            (None, Some(last)) if skip_finished_before.is_some_and(|t| created_ms < t) => {
                Admit::Finished(last)
            }
            (None, _) => Admit::After(0),
        }
    }

    /// Records a run and its creation time (a resumed run learns its real time here).
    pub fn track(&mut self, run_id: RunId, created_ms: i64, admit: Admit) {
        let entry = self.runs.entry(run_id).or_insert(RunPosition {
            created_ms,
            last: 0,
            done: false,
        });
        entry.created_ms = created_ms;
        match admit {
            Admit::After(last) => entry.last = entry.last.max(last),
            Admit::Finished(last) => {
                entry.last = entry.last.max(last);
                entry.done = true;
            }
        }
    }

    /// The last sequence sent of `run_id` (0 when unknown).
    #[must_use]
    pub fn last(&self, run_id: RunId) -> u64 {
        self.runs.get(&run_id).map_or(0, |r| r.last)
    }

    /// Whether `run_id` is done (its terminal item was sent, or it needs nothing more).
    #[must_use]
    pub fn is_done(&self, run_id: RunId) -> bool {
        self.runs.get(&run_id).is_some_and(|r| r.done)
    }

    /// Records that `sequence` of `run_id` was sent (`terminal`: the run's last item).
    pub fn sent(&mut self, run_id: RunId, sequence: u64, terminal: bool) {
        if let Some(run) = self.runs.get_mut(&run_id) {
            run.last = run.last.max(sequence);
            run.done |= terminal;
        }
    }

    /// Marks `run_id` done without a terminal item (it ended and the ledger has nothing
    /// more after its position, e.g. past retention).
    pub fn finish(&mut self, run_id: RunId) {
        if let Some(run) = self.runs.get_mut(&run_id) {
            run.done = true;
        }
    }

    /// The runs not done, oldest first.
    #[must_use]
    pub fn open(&self) -> Vec<RunId> {
        let mut open: Vec<(i64, RunId)> = self
            .runs
            .iter()
            .filter(|(_, r)| !r.done)
            .map(|(id, r)| (r.created_ms, *id))
            .collect();
        open.sort();
        open.into_iter().map(|(_, id)| id).collect()
    }

    /// The cursor of the current position; forgets the runs it no longer needs (created
    /// before the floor, all done).
    pub fn cursor(&mut self) -> ConversationCursor {
        let since_ms = self.since_ms();
        self.runs.retain(|_, r| r.created_ms >= since_ms);
        self.start_ms = self.start_ms.max(since_ms);
        let mut runs: Vec<(i64, RunId, u64)> = self
            .runs
            .iter()
            .map(|(id, r)| (r.created_ms, *id, r.last))
            .collect();
        runs.sort();
        ConversationCursor {
            since_ms,
            runs: runs.into_iter().map(|(_, id, last)| (id, last)).collect(),
        }
    }
}

/// Where a conversation stream starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamStart {
    /// The runs active at this time (epoch ms: when the request arrived), then every later
    /// run.
    Now(i64),
    /// Every run created from this time on (epoch ms), finished ones included.
    Since(i64),
    /// Resume after a frame's position.
    Resume(ConversationCursor),
}

fn millis(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

/// The SSE response of `GET /v1/conversations/{id}/stream`. The caller checked the
/// conversation id and took the key's stream `slot`.
pub fn conversation_stream(
    ctx: StreamContext,
    workspace: WorkspaceId,
    conversation: String,
    start: StreamStart,
    slot: StreamSlot,
) -> impl axum::response::IntoResponse {
    let (tx, rx) = mpsc::channel(ctx.options.buffer.max(1));
    let keep_alive = ctx.options.keep_alive;
    tokio::spawn(async move {
        let mut pump = ConversationPump {
            ctx: &ctx,
            workspace,
            conversation,
            tx: &tx,
            positions: Positions::new(0),
            holes: std::collections::HashMap::new(),
        };
        if let Err(Some(frame)) = pump.run(start).await {
            let _ = tx.send(frame).await;
        }
    });
    sse_from(rx, keep_alive, slot)
}

/// `Err(None)`: stop quietly (the client left, shutdown); `Err(Some(frame))`: send the
/// error frame, then stop.
type Stop = Option<Event>;

fn store_error_frame(err: &sb_store::StoreError) -> Event {
    let api = crate::error::ApiError::from_coded(err);
    tracing::warn!(error = %err, "conversation stream stopped by a store error");
    crate::stream::error_frame(api.code(), api.message(), serde_json::Map::new())
}

struct ConversationPump<'a> {
    ctx: &'a StreamContext,
    workspace: WorkspaceId,
    conversation: String,
    tx: &'a mpsc::Sender<Event>,
    positions: Positions,
    /// Runs whose ledger shows a hole right after their position, since when (see
    /// [`crate::stream::dense_prefix`]).
    holes: std::collections::HashMap<RunId, tokio::time::Instant>,
}

impl ConversationPump<'_> {
    async fn run(&mut self, start: StreamStart) -> Result<(), Stop> {
        // 1. Bind first.
        let mut watch: Watch = self
            .ctx
            .live
            .watch_conversation(self.workspace.as_str(), Some(&self.conversation))
            .await
            .map_err(|e| {
                let api = crate::error::ApiError::from_coded(&e);
                Some(crate::stream::error_frame(
                    api.code(),
                    api.message(),
                    serde_json::Map::new(),
                ))
            })?;
        // 2. Then the ledger of the runs the start covers.
        let skip_finished_before = match &start {
            StreamStart::Now(now_ms) => {
                let active = self
                    .ctx
                    .runs
                    .active_runs_for_conversation(&self.workspace, &self.conversation)
                    .await
                    .map_err(|e| Some(store_error_frame(&e)))?;
                let start_ms = active
                    .iter()
                    .map(|r| millis(r.created_at))
                    .min()
                    .unwrap_or(*now_ms)
                    .min(*now_ms);
                self.positions = Positions::new(start_ms);
                Some(*now_ms)
            }
            StreamStart::Since(ms) => {
                self.positions = Positions::new(*ms);
                None
            }
            StreamStart::Resume(cursor) => {
                self.positions = Positions::resume(cursor);
                None
            }
        };
        self.discover(skip_finished_before).await?;
        self.catch_up_open(true).await?;
        // 3. Then live items, with the ledger as gap filler and safety net.
        let mut live = true;
        let mut poll_at = tokio::time::Instant::now() + self.ctx.options.ledger_poll;
        loop {
            let poll = tokio::time::sleep_until(poll_at);
            tokio::select! {
                biased;
                () = self.ctx.shutdown.cancelled() => return Err(None),
                () = self.tx.closed() => return Err(None),
                item = watch.recv(), if live => match item {
                    Ok(message) => {
                        let run_id = message.run_id;
                        if !self.positions.knows(run_id) {
                            // A run that started after the listing. List again first: a run
                            // created before it whose items have not come yet must be known
                            // before the position moves past its creation (the cursor's
                            // `since` counts only known runs; an unknown one below it would
                            // read as finished).
                            self.discover(None).await?;
                        }
                        if !self.positions.knows(run_id) {
                            // Not listed (created before the floor, or not of this
                            // conversation): from its first item if it belongs.
                            match self.ctx.runs.get_run(run_id).await.map_err(|e| Some(store_error_frame(&e)))? {
                                Some(run) if self.belongs(&run) => {
                                    self.positions.track(run_id, millis(run.created_at), Admit::After(0));
                                }
                                _ => continue,
                            }
                        }
                        if self.positions.is_done(run_id) || message.sequence <= self.positions.last(run_id) {
                            continue; // already sent
                        }
                        if message.sequence == self.positions.last(run_id) + 1 {
                            let result = message
                                .to_result()
                                .with_run_id(run_id)
                                .with_sequence(message.sequence);
                            self.send(run_id, &result).await?;
                        } else {
                            self.catch_up(run_id).await?;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(skipped)) => {
                        tracing::debug!(skipped, "conversation stream lagged; reading the ledger");
                        self.discover(None).await?;
                        self.catch_up_open(false).await?;
                    }
                    Err(broadcast::error::RecvError::Closed) => live = false,
                },
                () = poll => {
                    self.discover(None).await?;
                    self.catch_up_open(true).await?;
                }
            }
            poll_at = tokio::time::Instant::now() + self.ctx.options.ledger_poll;
        }
    }

    fn belongs(&self, run: &RunRecord) -> bool {
        run.workspace_id == self.workspace
            && run.conversation_id.as_deref() == Some(self.conversation.as_str())
    }

    /// Lists the conversation's runs created at or after the floor and admits the ones not
    /// known yet.
    async fn discover(&mut self, skip_finished_before: Option<i64>) -> Result<(), Stop> {
        let floor = self.positions.since_ms().min(self.positions.start_ms);
        let mut cursor = None;
        let mut found: Vec<RunRecord> = Vec::new();
        loop {
            let mut filter = RunFilter::workspace(self.workspace.clone());
            filter.conversation_id = Some(self.conversation.clone());
            let page = self
                .ctx
                .runs
                .list_runs(filter, cursor, Some(RUN_PAGE))
                .await
                .map_err(|e| Some(store_error_frame(&e)))?;
            // Newest first: stop at the first run older than the floor.
            let mut older = false;
            for run in page.items {
                if millis(run.created_at) < floor {
                    older = true;
                    break;
                }
                found.push(run);
            }
            if older || !page.has_more || page.next_cursor.is_none() {
                break;
            }
            cursor = page.next_cursor;
        }
        for run in found.into_iter().rev() {
            let created_ms = millis(run.created_at);
            let ended_at = run
                .status
                .is_terminal()
                .then(|| u64::try_from(run.last_sequence).unwrap_or(0));
            let admit = self
                .positions
                .admit(run.id, created_ms, ended_at, skip_finished_before);
            self.positions.track(run.id, created_ms, admit);
        }
        Ok(())
    }

    /// Reads the ledger of every open run; `settle`: a run that has ended with nothing more
    /// in the ledger is done (its remaining items are past retention, or it had none).
    async fn catch_up_open(&mut self, settle: bool) -> Result<(), Stop> {
        for run_id in self.positions.open() {
            let run = if settle {
                self.ctx
                    .runs
                    .get_run(run_id)
                    .await
                    .map_err(|e| Some(store_error_frame(&e)))?
            } else {
                None
            };
            self.catch_up(run_id).await?;
            if let Some(run) = run {
                if run.status.is_terminal() && !self.positions.is_done(run_id) {
                    self.positions.finish(run_id);
                }
            }
        }
        Ok(())
    }

    /// Sends the ledger items of `run_id` that continue its position without a hole, up to
    /// its terminal item (a hole is waited for as in a run stream, see [`crate::stream`]).
    async fn catch_up(&mut self, run_id: RunId) -> Result<(), Stop> {
        let page = self.ctx.options.page_size.max(1);
        loop {
            let last = self.positions.last(run_id);
            let after = i64::try_from(last).unwrap_or(i64::MAX);
            let records = self
                .ctx
                .runs
                .events_after(run_id, after, page)
                .await
                .map_err(|e| Some(store_error_frame(&e)))?;
            let count = records.len() as u64;
            let records: Vec<_> = records
                .iter()
                .filter(|r| u64::try_from(r.sequence).is_ok_and(|s| s > last))
                .collect();
            let mut sendable = crate::stream::dense_prefix(
                last,
                records
                    .iter()
                    .map(|r| u64::try_from(r.sequence).unwrap_or_default()),
            );
            if sendable == 0 && !records.is_empty() {
                let since = *self
                    .holes
                    .entry(run_id)
                    .or_insert_with(tokio::time::Instant::now);
                if since.elapsed() < crate::stream::HOLE_PATIENCE {
                    return Ok(());
                }
                tracing::warn!(%run_id, after = last, next = records[0].sequence, "a hole in the run's ledger did not fill; skipping it");
                sendable = records.len();
            }
            if sendable > 0 {
                self.holes.remove(&run_id);
            }
            for record in &records[..sendable] {
                if self.positions.is_done(run_id) {
                    return Ok(());
                }
                self.send(run_id, &record_to_result(record)).await?;
            }
            if sendable < records.len() || count < page || self.positions.is_done(run_id) {
                return Ok(());
            }
        }
    }

    async fn send(&mut self, run_id: RunId, result: &AgentRunResult) -> Result<(), Stop> {
        let sequence = result.sequence.unwrap_or_default();
        self.positions.sent(run_id, sequence, result.is_terminal());
        let frame = Event::default()
            .id(self.positions.cursor().to_string())
            .event(frame_event_name(&result.result_type))
            .data(serde_json::to_string(result).unwrap_or_else(|_| "{}".to_owned()));
        tokio::select! {
            biased;
            () = self.ctx.shutdown.cancelled() => Err(None),
            sent = self.tx.send(frame) => sent.map_err(|_| None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<RunId> {
        (0..n).map(|_| RunId::new()).collect()
    }

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let [a, b] = ids(2).try_into().unwrap();
        let cursor = ConversationCursor {
            since_ms: 1_700_000_000_123,
            runs: vec![(a, 4), (b, 0)],
        };
        let text = cursor.to_string();
        assert_eq!(text, format!("c1.1700000000123.{a}:4.{b}:0"));
        assert_eq!(text.parse::<ConversationCursor>().unwrap(), cursor);
        assert_eq!(
            "c1.5".parse::<ConversationCursor>().unwrap(),
            ConversationCursor {
                since_ms: 5,
                runs: vec![]
            }
        );
        for bad in [
            "",
            "7",
            "c2.5",
            "c1",
            "c1.-1",
            "c1.x",
            "c1.5.nope",
            "c1.5.nope:1",
            &format!("c1.5.{a}:x"),
            &format!("c1.5.{a}"),
        ] {
            assert!(bad.parse::<ConversationCursor>().is_err(), "{bad:?}");
        }
        let long = format!("c1.5{}", format!(".{a}:1").repeat(MAX_CURSOR_RUNS + 1));
        assert!(long.parse::<ConversationCursor>().is_err());
    }

    #[test]
    fn the_floor_follows_the_oldest_open_run() {
        let [a, b, c] = ids(3).try_into().unwrap();
        let mut p = Positions::new(100);
        assert_eq!(p.cursor().since_ms, 100, "nothing known: the start");
        p.track(a, 110, Admit::After(0));
        p.track(b, 120, Admit::After(0));
        p.track(c, 130, Admit::After(0));
        p.sent(a, 1, false);
        p.sent(c, 3, true);
        let cursor = p.cursor();
        assert_eq!(cursor.since_ms, 110);
        assert_eq!(cursor.runs, vec![(a, 1), (b, 0), (c, 3)]);
        // a ends: b is the oldest open run; a is forgotten (finished, before the floor).
        p.sent(a, 2, true);
        let cursor = p.cursor();
        assert_eq!(cursor.since_ms, 120);
        assert_eq!(cursor.runs, vec![(b, 0), (c, 3)]);
        // All done: the floor is the newest run, which stays listed as done.
        p.sent(b, 5, true);
        let cursor = p.cursor();
        assert_eq!(cursor.since_ms, 130);
        assert_eq!(cursor.runs, vec![(c, 3)]);
    }

    #[test]
    fn a_resume_keeps_positions_skips_what_ended_before_and_streams_new_runs() {
        let [open, done_listed, old, new] = ids(4).try_into().unwrap();
        let cursor = ConversationCursor {
            since_ms: 200,
            runs: vec![(open, 3), (done_listed, 9)],
        };
        let p = Positions::resume(&cursor);
        assert_eq!(p.admit(open, 200, None, None), Admit::After(3));
        assert_eq!(p.admit(done_listed, 250, Some(9), None), Admit::After(9));
        assert_eq!(
            p.admit(old, 150, Some(4), None),
            Admit::Finished(4),
            "unlisted and before the floor: finished"
        );
        assert_eq!(p.admit(new, 260, None, None), Admit::After(0));
        assert_eq!(
            p.admit(new, 260, Some(2), None),
            Admit::After(0),
            "a resume streams a run it never saw, even if it ended meanwhile"
        );
        // A fresh stream (asked for at 300) leaves out what ended before it started, and so
        // does its cursor; a run created since is streamed whole even when it has ended by
        // the first listing.
        let mut fresh = Positions::new(200);
        assert_eq!(
            fresh.admit(new, 260, Some(2), Some(300)),
            Admit::Finished(2)
        );
        assert_eq!(fresh.admit(open, 270, None, Some(300)), Admit::After(0));
        let quick = RunId::new();
        assert_eq!(fresh.admit(quick, 300, Some(5), Some(300)), Admit::After(0));
        fresh.track(new, 260, Admit::Finished(2));
        fresh.track(open, 270, Admit::After(0));
        let cursor = fresh.cursor();
        assert_eq!(cursor.runs, vec![(open, 0)], "the floor is the open run");
        let mut fresh = Positions::new(200);
        fresh.track(new, 280, Admit::Finished(2));
        fresh.track(open, 270, Admit::After(0));
        let resumed = Positions::resume(&fresh.cursor());
        assert_eq!(
            resumed.admit(new, 280, Some(2), None),
            Admit::After(2),
            "listed at its end: nothing is streamed again"
        );
    }

    #[test]
    fn a_resumed_cursor_continues_where_the_frame_was() {
        let [a, b] = ids(2).try_into().unwrap();
        let mut p = Positions::new(0);
        p.track(a, 10, Admit::After(0));
        p.track(b, 20, Admit::After(0));
        p.sent(a, 2, false);
        p.sent(b, 1, true);
        let cursor = p.cursor();
        let mut resumed = Positions::resume(&cursor.to_string().parse().unwrap());
        for (id, created) in [(a, 10), (b, 20)] {
            let admit = resumed.admit(id, created, None, None);
            resumed.track(id, created, admit);
        }
        assert_eq!(resumed.last(a), 2);
        assert_eq!(resumed.last(b), 1);
        assert_eq!(
            resumed.open(),
            vec![a, b],
            "b's end is learnt from its ledger"
        );
        resumed.sent(b, 1, true);
        resumed.sent(a, 3, false);
        assert_eq!(resumed.cursor().since_ms, 10);
        assert_eq!(resumed.open(), vec![a]);
    }
}
