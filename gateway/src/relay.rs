//! The outbox relay: publishes the messages that committed transactions left in the outbox.
//!
//! Ingest writes the event row and its `switchboard.event/1` outbox row in one transaction
//! (SPEC §2 step 1); the relay does the publishing. So an accepted event is never lost while
//! the broker is down: its row waits, and the relay publishes it once the broker is back.
//!
//! Rows reach the relay two ways:
//!
//! - **Handed over** ([`RelayHandle::hand`]): the ingest's group commit
//!   ([`crate::ingest`]) writes the rows of `POST /v1/events` already leased to this relay
//!   ([`EventLog::append_batch`](sb_store::EventLog::append_batch)) and passes them on, so
//!   they are published right after the commit without a claim statement.
//! - **Claimed** ([`Outbox::claim`]): rows written by anything else (which only
//!   [`wakes`](RelayHandle::wake) the relay), rows whose lease ran out (a relay that died
//!   after the commit), rows due later and rows left by a broker outage. The poll interval
//!   makes this the recovery path: nothing committed waits on a hand-over that never
//!   comes.
//!
//! One round:
//!
//! ```text
//!  handed rows ─┐
//!  claim(batch, lease) (when woken, polled, or after a failure)
//!        │ rows
//!        ▼
//!  pack: one message per shard's events
//!        │
//!        ▼
//!  publish_batch (confirmed) ──all ok──▶ ids join the unmarked ──▶ wait for a hand-over, a
//!        │ some failed                                            wake, the poll, the mark
//!        ▼                                                        delay or shutdown
//!  ok ids join the unmarked, release(failed ones), back off (exponential, capped)
//!
//!  unmarked ids ──mark_delay after the first, or MARK_AT_ONCE of them, or shutdown──▶
//!  mark_published(all of them)
//! ```
//!
//! **One message per shard and round**: the event pointers a round publishes to one events
//! shard go as one [`EventBatch`] (`pack`). A queued message costs the broker a replicated
//! write, a delivery and a settlement whatever it holds, and under load a round carries the
//! events of several ingest commits; the orchestrator routes each event of a batch in its own
//! lane and settles the message once. A round of one event publishes it as it always was.
//!
//! **Marks are deferred**: a confirmed row stays leased to this relay (its lease is seconds,
//! the mark delay a fraction of it), so nobody claims it meanwhile, and a busy relay marks a
//! few times a second in one statement instead of once per round — on SQLite every round's
//! mark was a command of the one writer, as many as the ingest commits. [`OutboxRelay::round`]
//! still settles its rows before it returns.
//!
//! Delivery is at-least-once: a crash between the confirm and `mark_published` (or a lease
//! that ran out mid-publish) publishes a row again, and the orchestrator dedupes on the
//! event id. Several gateways can relay the same outbox: claims are leased, so a row is
//! worked on by one relay at a time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sb_common::bus::{Bus, Outgoing, PublishOptions};
use sb_common::retry::RetryPolicy;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::messages::{self, EventBatch, EventMessage};
use sb_store::events::{Outbox, OutboxMessage};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Tuning of the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOptions {
    /// Rows claimed and published per round.
    pub batch: u64,
    /// How long a claim is held before another relay may take the rows. Must comfortably
    /// exceed one publish round trip.
    pub lease: Duration,
    /// How long rows handed over by the ingest are leased to this relay: short, since they
    /// are published at once, and since the rows of a relay that died after the commit wait
    /// this long before any relay claims them.
    pub handover_lease: Duration,
    /// How often to look for rows nobody woke us for (other gateways' rows after they died,
    /// rows left by a broker outage).
    pub poll_interval: Duration,
    /// How long confirmed rows wait to be marked published, so that the rows of many rounds
    /// are marked together. Must stay well below `handover_lease` (and `lease`): a row is
    /// protected from other relays by its lease only until it is marked.
    pub mark_delay: Duration,
    /// Back-off after failed rounds (bounded, so that publishing resumes within seconds of
    /// the broker coming back).
    pub retry: RetryPolicy,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch: 100,
            // A confirmed batch takes milliseconds; 30 s leaves room for a slow broker without
            // stalling rows of a crashed relay for long.
            lease: Duration::from_secs(30),
            // `gateway.outbox_handover_lease`, `gateway.outbox_mark_delay`: see there.
            handover_lease: Duration::from_secs(5),
            poll_interval: Duration::from_millis(500),
            mark_delay: Duration::from_millis(200),
            retry: RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(5)),
        }
    }
}

/// Wakes the relay after an ingest committed, and hands it leased rows. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct RelayHandle {
    inner: Arc<HandleInner>,
}

#[derive(Debug, Default)]
struct HandleInner {
    notify: Notify,
    /// A claim round is wanted: rows were written without a lease.
    claim: AtomicBool,
    /// Rows handed over and not yet taken by the relay loop.
    handed: Mutex<Vec<OutboxMessage>>,
    /// A relay loop is running on this handle (rows handed over will be published).
    attached: AtomicBool,
}

impl RelayHandle {
    /// A handle whose relay is not started yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the relay to claim and publish now. Wakes coalesce: many ingests during one
    /// round cause one more round, not many.
    pub fn wake(&self) {
        self.inner.claim.store(true, Ordering::Release);
        self.inner.notify.notify_one();
    }

    /// Whether a relay loop runs on this handle, so rows handed over get published. Rows
    /// should be written leased only then: without a relay they would wait for their lease
    /// to run out.
    pub fn is_attached(&self) -> bool {
        self.inner.attached.load(Ordering::Acquire)
    }

    /// Hands rows leased to this relay ([`Appended::leased`](sb_store::Appended::leased)) to
    /// the relay loop, which publishes them without claiming them.
    pub fn hand(&self, rows: Vec<OutboxMessage>) {
        if rows.is_empty() {
            return;
        }
        self.handed().extend(rows);
        self.inner.notify.notify_one();
    }

    pub(crate) fn take_handed(&self) -> Vec<OutboxMessage> {
        std::mem::take(&mut *self.handed())
    }

    fn handed(&self) -> std::sync::MutexGuard<'_, Vec<OutboxMessage>> {
        // A panic while holding the lock leaves a valid `Vec`: keep using it.
        self.inner
            .handed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take_claim(&self) -> bool {
        self.inner.claim.swap(false, Ordering::AcqRel)
    }
}

/// Marks a handle attached for as long as a relay loop runs on it.
pub(crate) struct Attached<'a>(&'a RelayHandle);

impl<'a> Attached<'a> {
    pub(crate) fn new(handle: &'a RelayHandle) -> Self {
        handle.inner.attached.store(true, Ordering::Release);
        Self(handle)
    }
}

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        self.0.inner.attached.store(false, Ordering::Release);
    }
}

/// What one relay round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoundReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows published and marked.
    pub published: usize,
    /// Rows released after a failed publish.
    pub failed: usize,
}

/// The relay loop.
pub struct OutboxRelay {
    outbox: Arc<dyn Outbox>,
    bus: Arc<dyn Bus>,
    handle: RelayHandle,
    options: RelayOptions,
    metrics: &'static Metrics,
}

impl OutboxRelay {
    /// A relay woken through `handle`.
    pub fn new(
        outbox: Arc<dyn Outbox>,
        bus: Arc<dyn Bus>,
        handle: RelayHandle,
        options: RelayOptions,
    ) -> Self {
        Self {
            outbox,
            bus,
            handle,
            options,
            metrics: Metrics::global(),
        }
    }

    /// Runs rounds until `shutdown` is cancelled. A round in flight is finished (its rows
    /// are marked or released), so nothing stays leased needlessly after a clean shutdown.
    pub async fn run(self, shutdown: CancellationToken) {
        let _attached = Attached::new(&self.handle);
        let (unmarked, marks) = tokio::sync::mpsc::unbounded_channel();
        let marker = tokio::spawn(mark_deferred(
            Arc::clone(&self.outbox),
            marks,
            self.options.mark_delay,
            self.options.retry,
        ));
        let mut retry = self.options.retry.start();
        let mut gauge_due = tokio::time::Instant::now();
        // The first round claims: rows may have been left by an earlier run.
        let mut claim = true;
        tracing::info!(batch = self.options.batch, "outbox relay started");
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            if tokio::time::Instant::now() >= gauge_due {
                // A count per interval, not per round: rounds run once per ingest commit.
                gauge_due = tokio::time::Instant::now() + PENDING_GAUGE_INTERVAL;
                match self.outbox.pending().await {
                    Ok(n) => self.metrics.set(names::OUTBOX_PENDING, &[], n as f64),
                    Err(error) => tracing::debug!(%error, "counting pending outbox rows failed"),
                }
            }
            claim |= self.handle.take_claim();
            let mut published = Vec::new();
            let round = self
                .publish_round(self.handle.take_handed(), claim, &mut published)
                .await;
            if !published.is_empty() {
                // Only fails once the marker is gone, which it is not before the loop ends.
                let _ = unmarked.send(published);
            }
            let pause = match round {
                Ok(report) if report.failed == 0 => {
                    retry.reset();
                    // A full claim: there is probably more; go again at once. Otherwise
                    // nothing else was claimable, and rows written since then woke the
                    // relay during the round (`Notify` keeps that wake-up for the wait
                    // below), so no extra (empty) claim is needed to find them.
                    claim = claim && report.claimed as u64 >= self.options.batch;
                    if claim {
                        continue;
                    }
                    None
                }
                Ok(report) => {
                    tracing::warn!(
                        failed = report.failed,
                        published = report.published,
                        "outbox publish failed; backing off"
                    );
                    claim = true;
                    Some(retry.next_delay())
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox relay round failed; backing off");
                    claim = true;
                    Some(retry.next_delay())
                }
            };
            let sleep = pause.unwrap_or(self.options.poll_interval);
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                // After a failure only the timer ends the pause: waking early would hammer a
                // broker that is down.
                () = self.handle.inner.notify.notified(), if pause.is_none() => {}
                () = tokio::time::sleep(sleep) => claim = true,
            }
        }
        // The marker marks what it holds once its channel closes.
        drop(unmarked);
        if let Err(error) = marker.await {
            tracing::warn!(%error, "outbox marker task failed");
        }
        tracing::info!("outbox relay stopped");
    }

    /// Claims, publishes and settles one batch: the published rows are marked before it
    /// returns.
    pub async fn round(&self) -> Result<RoundReport, sb_store::StoreError> {
        let mut published = Vec::new();
        let report = self.publish_round(Vec::new(), true, &mut published).await;
        if !published.is_empty() {
            self.outbox.mark_published(&published).await?;
        }
        report
    }

    /// Publishes `handed` rows together with a claimed batch if `claim` (one confirmed
    /// publish for both) and releases those not confirmed; the ids of the confirmed rows are
    /// added to `published`, for the caller to mark, also when an error is returned after
    /// the publish. If the claim fails, the handed rows are still published before the
    /// error is returned.
    async fn publish_round(
        &self,
        mut rows: Vec<OutboxMessage>,
        claim: bool,
        published: &mut Vec<i64>,
    ) -> Result<RoundReport, sb_store::StoreError> {
        let mut claimed = 0;
        if claim {
            match self
                .outbox
                .claim(self.options.batch, self.options.lease)
                .await
            {
                Ok(batch) => {
                    claimed = batch.len();
                    rows.extend(batch);
                }
                Err(error) => {
                    self.publish(rows, published).await?;
                    return Err(error);
                }
            }
        }
        Ok(RoundReport {
            claimed,
            ..self.publish(rows, published).await?
        })
    }

    /// Publishes leased rows (confirmed), adds the ids of the confirmed ones to `published`
    /// and releases the others.
    async fn publish(
        &self,
        rows: Vec<OutboxMessage>,
        published: &mut Vec<i64>,
    ) -> Result<RoundReport, sb_store::StoreError> {
        if rows.is_empty() {
            return Ok(RoundReport::default());
        }
        let packed = pack(&rows);
        let (messages, carried): (Vec<Outgoing>, Vec<Vec<i64>>) = packed.into_iter().unzip();
        let exchanges: Vec<String> = messages.iter().map(|m| m.exchange.clone()).collect();
        let (confirmed, failed): (Vec<i64>, Vec<i64>) = match self.bus.publish_batch(messages).await
        {
            Ok(()) => (carried.concat(), Vec::new()),
            Err(err) => {
                if let Some((index, first)) = err.failed.first() {
                    tracing::warn!(rows = ?carried[*index], error = %first, failed = err.failed.len(), "outbox rows not confirmed");
                }
                split_ids(&carried, |i| err.is_failed(i))
            }
        };
        for (exchange, ids) in exchanges.iter().zip(&carried) {
            if ids.first().is_some_and(|id| failed.contains(id)) {
                continue;
            }
            // The base name (`events`, `runs`, …): low cardinality whatever the prefix.
            let exchange = exchange.rsplit('.').next().unwrap_or_default();
            self.metrics
                .inc(names::BUS_PUBLISHED_TOTAL, &[("exchange", exchange)]);
        }
        let report = RoundReport {
            claimed: 0,
            published: confirmed.len(),
            failed: failed.len(),
        };
        // Before the release, which may fail: confirmed rows are marked either way.
        published.extend(confirmed);
        if !failed.is_empty() {
            // Give them back at once so any relay (maybe one with a working connection) can
            // retry; if this fails too, the lease expiry returns them.
            self.outbox.release(&failed).await?;
        }
        Ok(report)
    }
}

/// Marking many confirmed rows at once is one statement per chunk; beyond this many the
/// marker does not wait for the delay.
const MARK_AT_ONCE: usize = 1_000;

/// The relay loop's marker: marks the ids it receives published, together, `delay` after the
/// first of them arrived (or at once when [`MARK_AT_ONCE`] are waiting), and what it still
/// holds when the channel closes. A failed mark keeps its ids for the next one, tried after
/// `retry`'s back-off (at least `delay`): until they are marked, the rows stay leased to this
/// relay, and if the lease runs out first they are published again (at-least-once, as after
/// a crash).
async fn mark_deferred(
    outbox: Arc<dyn Outbox>,
    mut marks: tokio::sync::mpsc::UnboundedReceiver<Vec<i64>>,
    delay: Duration,
    retry: RetryPolicy,
) {
    let mut ids: Vec<i64> = Vec::new();
    let mut failures = retry.start();
    // The wait before the next mark: `delay`, or the back-off after failed marks.
    let mut wait = delay;
    // The last mark failed: the next one waits its whole `wait`, however many ids wait.
    let mut backing_off = false;
    let mut open = true;
    while open {
        if ids.is_empty() {
            match marks.recv().await {
                Some(more) => ids.extend(more),
                None => break,
            }
        }
        let due = tokio::time::Instant::now() + wait;
        let at_once = if backing_off {
            usize::MAX
        } else {
            MARK_AT_ONCE
        };
        while ids.len() < at_once {
            tokio::select! {
                more = marks.recv() => match more {
                    Some(more) => ids.extend(more),
                    None => {
                        open = false;
                        break;
                    }
                },
                () = tokio::time::sleep_until(due) => break,
            }
        }
        if ids.is_empty() {
            continue;
        }
        match outbox.mark_published(&ids).await {
            Ok(()) => {
                ids.clear();
                failures.reset();
                wait = delay;
                backing_off = false;
            }
            Err(error) => {
                wait = delay.max(failures.next_delay());
                backing_off = true;
                tracing::warn!(%error, rows = ids.len(), retry_in = ?wait, "marking outbox rows published failed; retrying");
            }
        }
    }
}

/// How often the relay refreshes `sb_outbox_pending`.
const PENDING_GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Splits the row ids that messages carry into (confirmed, failed) by message index.
fn split_ids(carried: &[Vec<i64>], failed: impl Fn(usize) -> bool) -> (Vec<i64>, Vec<i64>) {
    let mut good = Vec::with_capacity(carried.len());
    let mut bad = Vec::new();
    for (index, ids) in carried.iter().enumerate() {
        if failed(index) {
            bad.extend_from_slice(ids)
        } else {
            good.extend_from_slice(ids)
        }
    }
    (good, bad)
}

/// The bus messages of a round's rows, each with the ids of the rows it carries, in the
/// order to publish them.
///
/// The rows holding an event pointer (`switchboard.event/1`) for one exchange and routing key
/// (one events shard) go as one [`EventBatch`] (at most [`EventBatch::MAX_EVENTS`] each): a
/// queued message costs the broker far more than its bytes, and under load a round carries
/// the events of several ingest commits. A lone pointer keeps the single form. Every other
/// row is a message of its own, and breaks the batch of its exchange and key, so the
/// messages of one queue keep the order of their rows.
fn pack(rows: &[OutboxMessage]) -> Vec<(Outgoing, Vec<i64>)> {
    /// The messages of one exchange and key, in row order: runs of event pointers, and
    /// other rows alone.
    enum Part<'a> {
        Events(Vec<(EventMessage, &'a OutboxMessage)>),
        Other(&'a OutboxMessage),
    }
    let mut destinations: Vec<(&str, &str, Vec<Part<'_>>)> = Vec::new();
    for row in rows {
        let at = match destinations
            .iter()
            .position(|(exchange, key, _)| *exchange == row.exchange && *key == row.routing_key)
        {
            Some(at) => at,
            None => {
                destinations.push((&row.exchange, &row.routing_key, Vec::new()));
                destinations.len() - 1
            }
        };
        let parts = &mut destinations[at].2;
        match messages::decode::<EventMessage>(&row.body) {
            Ok(event) => match parts.last_mut() {
                Some(Part::Events(events)) if events.len() < EventBatch::MAX_EVENTS => {
                    events.push((event, row));
                }
                _ => parts.push(Part::Events(vec![(event, row)])),
            },
            Err(_) => parts.push(Part::Other(row)),
        }
    }
    destinations
        .into_iter()
        .flat_map(|(_, _, parts)| parts)
        .map(|part| match part {
            Part::Other(row) => as_it_is(row),
            Part::Events(events) if events.len() == 1 => as_it_is(events[0].1),
            Part::Events(events) => {
                let ids = events.iter().map(|(_, row)| row.id).collect();
                let row = events[0].1;
                let batch = EventBatch::new(events.into_iter().map(|(event, _)| event).collect());
                (to_outgoing(row, Bytes::from(messages::encode(&batch))), ids)
            }
        })
        .collect()
}

/// The bus message of one outbox row, its body as written, with the row's id.
fn as_it_is(row: &OutboxMessage) -> (Outgoing, Vec<i64>) {
    (
        to_outgoing(row, Bytes::from(row.body.clone())),
        vec![row.id],
    )
}

/// The bus message with `body` to an outbox row's exchange and key: mandatory and persistent
/// (an event nobody can receive must fail loudly and stay in the outbox, not vanish).
fn to_outgoing(row: &OutboxMessage, body: Bytes) -> Outgoing {
    Outgoing {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        body,
        options: PublishOptions::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An outbox row with `body` to `key` of the events exchange.
    fn row(id: i64, key: &str, body: Vec<u8>) -> OutboxMessage {
        let now = chrono::Utc::now();
        OutboxMessage {
            id,
            exchange: "switchboard.events".into(),
            routing_key: key.into(),
            body,
            headers: None,
            created_at: now,
            available_at: now,
            locked_until: None,
            attempts: 1,
        }
    }

    fn event(lane: u64) -> EventMessage {
        EventMessage::new(
            sb_protocol::ids::WorkspaceId::default_workspace(),
            sb_protocol::ids::EventId::new(),
        )
        .in_lane(lane)
    }

    #[test]
    fn a_rounds_events_go_as_one_message_per_shard_in_row_order() {
        let events: Vec<EventMessage> = (0..6).map(event).collect();
        let rows = vec![
            row(1, "shard.0", messages::encode(&events[0])),
            row(2, "shard.1", messages::encode(&events[1])),
            row(3, "shard.0", messages::encode(&events[2])),
            // Not an event pointer: a message of its own, which ends shard 0's batch.
            row(4, "shard.0", b"{\"schema\":\"switchboard.job/1\"}".to_vec()),
            row(5, "shard.0", messages::encode(&events[3])),
            row(6, "shard.0", messages::encode(&events[4])),
            row(7, "shard.2", messages::encode(&events[5])),
        ];
        let packed = pack(&rows);
        let ids: Vec<Vec<i64>> = packed.iter().map(|(_, ids)| ids.clone()).collect();
        assert_eq!(ids, [vec![1, 3], vec![4], vec![5, 6], vec![2], vec![7]]);
        let keys: Vec<&str> = packed.iter().map(|(m, _)| m.routing_key.as_str()).collect();
        assert_eq!(
            keys,
            ["shard.0", "shard.0", "shard.0", "shard.1", "shard.2"]
        );
        let decoded = |at: usize| messages::decode_events(&packed[at].0.body).unwrap();
        assert_eq!(decoded(0), [events[0].clone(), events[2].clone()]);
        assert_eq!(decoded(2), [events[3].clone(), events[4].clone()]);
        // The others as they were: a lone event keeps the single form.
        assert_eq!(packed[1].0.body, rows[3].body);
        assert_eq!(packed[3].0.body, rows[1].body);
        assert_eq!(packed[4].0.body, rows[6].body);
    }

    #[test]
    fn an_event_batch_holds_at_most_its_maximum() {
        let rows: Vec<OutboxMessage> = (0..EventBatch::MAX_EVENTS as i64 * 2 + 1)
            .map(|id| row(id, "shard.0", messages::encode(&event(1))))
            .collect();
        let sizes: Vec<usize> = pack(&rows).iter().map(|(_, ids)| ids.len()).collect();
        assert_eq!(sizes, [EventBatch::MAX_EVENTS, EventBatch::MAX_EVENTS, 1]);
    }

    #[test]
    fn split_ids_fails_every_row_of_a_failed_message() {
        let carried = vec![vec![1, 2], vec![3], vec![4, 5], vec![6]];
        assert_eq!(
            split_ids(&carried, |at| at == 1 || at == 2),
            (vec![1, 2, 6], vec![3, 4, 5])
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut b =
            RetryPolicy::new(Duration::from_millis(100), Duration::from_millis(350)).start();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        assert_eq!(b.next_delay(), Duration::from_millis(200));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
    }

    /// An outbox whose first `failures` marks fail; records when each mark was tried.
    struct FlakyMarks {
        failures: std::sync::atomic::AtomicUsize,
        tries: Mutex<Vec<(Duration, Vec<i64>)>>,
        start: tokio::time::Instant,
    }

    #[async_trait::async_trait]
    impl Outbox for FlakyMarks {
        async fn enqueue(
            &self,
            _: Vec<sb_store::events::NewOutboxMessage>,
        ) -> Result<Vec<i64>, sb_store::StoreError> {
            Ok(Vec::new())
        }
        async fn claim(
            &self,
            _: u64,
            _: Duration,
        ) -> Result<Vec<OutboxMessage>, sb_store::StoreError> {
            Ok(Vec::new())
        }
        async fn mark_published(&self, ids: &[i64]) -> Result<(), sb_store::StoreError> {
            let at = self.start.elapsed();
            self.tries.lock().unwrap().push((at, ids.to_vec()));
            let failing = self
                .failures
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok();
            if failing {
                Err(sb_store::StoreError::Conflict(
                    "the database is down".into(),
                ))
            } else {
                Ok(())
            }
        }
        async fn release(&self, _: &[i64]) -> Result<(), sb_store::StoreError> {
            Ok(())
        }
        async fn pending(&self) -> Result<u64, sb_store::StoreError> {
            Ok(0)
        }
        async fn delete_published_before(
            &self,
            _: chrono::DateTime<chrono::Utc>,
            _: u64,
        ) -> Result<u64, sb_store::StoreError> {
            Ok(0)
        }
    }

    /// Runs the marker (200 ms delay, back-off from 100 ms) on an outbox whose first three
    /// marks fail, sends it `ids`, and returns when each mark was tried (ms) and with what.
    async fn marks_of_a_flaky_outbox(ids: Vec<i64>) -> Vec<(u128, Vec<i64>)> {
        let outbox = Arc::new(FlakyMarks {
            failures: 3.into(),
            tries: Mutex::new(Vec::new()),
            start: tokio::time::Instant::now(),
        });
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let marker = tokio::spawn(mark_deferred(
            Arc::clone(&outbox) as Arc<dyn Outbox>,
            rx,
            Duration::from_millis(200),
            RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(5)),
        ));
        tx.send(ids).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(tx);
        marker.await.unwrap();
        let tries = outbox.tries.lock().unwrap().clone();
        tries
            .into_iter()
            .map(|(at, ids)| (at.as_millis(), ids))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_mark_is_retried_with_back_off_and_keeps_its_ids() {
        let tries = marks_of_a_flaky_outbox(vec![1, 2]).await;
        let ms: Vec<u128> = tries.iter().map(|(at, _)| *at).collect();
        // The mark delay, then the back-off (100, 200, 400 ms) but never less than the delay.
        assert_eq!(ms, vec![200, 400, 600, 1000]);
        assert!(tries.iter().all(|(_, ids)| ids == &vec![1, 2]), "{tries:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn many_waiting_ids_do_not_cut_the_pause_after_a_failed_mark_short() {
        let ids: Vec<i64> = (0..MARK_AT_ONCE as i64).collect();
        let tries = marks_of_a_flaky_outbox(ids.clone()).await;
        let ms: Vec<u128> = tries.iter().map(|(at, _)| *at).collect();
        // At once (enough ids), then never sooner than the delay after a failure.
        assert_eq!(ms, vec![0, 200, 400, 800]);
        assert!(tries.iter().all(|(_, tried)| tried == &ids));
    }
}
