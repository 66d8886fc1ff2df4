//! The outbox relay: publishes the messages that committed transactions left in the outbox.
//!
//! Ingest writes the event row and its `switchboard.event/1` outbox row in one transaction
//! (SPEC §2 step 1) and then only [`wakes`](RelayHandle::wake) the relay; the relay does the
//! publishing. So an accepted event is never lost while the broker is down: its row waits,
//! and the relay publishes it once the broker is back.
//!
//! One round:
//!
//! ```text
//!  claim(batch, lease) ──none──▶ sleep until woken, poll interval, or shutdown
//!        │ rows
//!        ▼
//!  publish_batch (confirmed) ──all ok──▶ mark_published(all) ──▶ next round at once
//!        │ some failed
//!        ▼
//!  mark_published(ok ones), release(failed ones), back off (exponential, capped)
//! ```
//!
//! Delivery is at-least-once: a crash between the confirm and `mark_published` (or a lease
//! that ran out mid-publish) publishes a row again, and the orchestrator dedupes on the
//! event id. Several gateways can relay the same outbox: claims are leased, so a row is
//! worked on by one relay at a time.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sb_common::bus::{Bus, Outgoing, PublishOptions};
use sb_common::retry::RetryPolicy;
use sb_common::telemetry::{Metrics, names};
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
    /// How often to look for rows nobody woke us for (other gateways' rows after they died,
    /// rows left by a broker outage).
    pub poll_interval: Duration,
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
            poll_interval: Duration::from_millis(500),
            retry: RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(5)),
        }
    }
}

/// Wakes the relay after an ingest committed. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct RelayHandle {
    notify: Arc<Notify>,
}

impl RelayHandle {
    /// A handle whose relay is not started yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the relay to run a round now. Wakes coalesce: many ingests during one round
    /// cause one more round, not many.
    pub fn wake(&self) {
        self.notify.notify_one();
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
        let mut retry = self.options.retry.start();
        let mut gauge_due = tokio::time::Instant::now();
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
            let pause = match self.round().await {
                Ok(report) if report.failed == 0 => {
                    retry.reset();
                    if report.claimed as u64 >= self.options.batch {
                        // A full batch: there is probably more; go again at once.
                        continue;
                    }
                    // Not full: nothing else was claimable. Rows committed since then woke
                    // the relay during the round, and `Notify` keeps that wake-up for the
                    // wait below, so no extra (empty) claim is needed to find them.
                    None
                }
                Ok(report) => {
                    tracing::warn!(
                        failed = report.failed,
                        published = report.published,
                        "outbox publish failed; backing off"
                    );
                    Some(retry.next_delay())
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox relay round failed; backing off");
                    Some(retry.next_delay())
                }
            };
            let sleep = pause.unwrap_or(self.options.poll_interval);
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                // After a failure only the timer ends the pause: waking early would hammer a
                // broker that is down.
                () = self.handle.notify.notified(), if pause.is_none() => {}
                () = tokio::time::sleep(sleep) => {}
            }
        }
        tracing::info!("outbox relay stopped");
    }

    /// Claims, publishes and settles one batch.
    pub async fn round(&self) -> Result<RoundReport, sb_store::StoreError> {
        let rows = self
            .outbox
            .claim(self.options.batch, self.options.lease)
            .await?;
        if rows.is_empty() {
            return Ok(RoundReport::default());
        }
        let claimed = rows.len();
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let messages: Vec<Outgoing> = rows.iter().map(to_outgoing).collect();
        let (published, failed): (Vec<i64>, Vec<i64>) = match self.bus.publish_batch(messages).await
        {
            Ok(()) => (ids, Vec::new()),
            Err(err) => {
                if let Some((index, first)) = err.failed.first() {
                    tracing::warn!(row = ids[*index], error = %first, failed = err.failed.len(), "outbox rows not confirmed");
                }
                split_ids(&ids, |i| err.is_failed(i))
            }
        };
        if !published.is_empty() {
            self.outbox.mark_published(&published).await?;
            for row in rows.iter().filter(|r| published.contains(&r.id)) {
                // The base name (`events`, `runs`, …): low cardinality whatever the prefix.
                let exchange = row.exchange.rsplit('.').next().unwrap_or_default();
                self.metrics
                    .inc(names::BUS_PUBLISHED_TOTAL, &[("exchange", exchange)]);
            }
        }
        if !failed.is_empty() {
            // Give them back at once so any relay (maybe one with a working connection) can
            // retry; if this fails too, the lease expiry returns them.
            self.outbox.release(&failed).await?;
        }
        Ok(RoundReport {
            claimed,
            published: published.len(),
            failed: failed.len(),
        })
    }
}

/// How often the relay refreshes `sb_outbox_pending`.
const PENDING_GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Splits row ids into (confirmed, failed) by batch index.
fn split_ids(ids: &[i64], failed: impl Fn(usize) -> bool) -> (Vec<i64>, Vec<i64>) {
    let mut good = Vec::with_capacity(ids.len());
    let mut bad = Vec::new();
    for (index, id) in ids.iter().enumerate() {
        if failed(index) {
            bad.push(*id)
        } else {
            good.push(*id)
        }
    }
    (good, bad)
}

/// The bus message of an outbox row: mandatory and persistent (an event nobody can receive
/// must fail loudly and stay in the outbox, not vanish).
fn to_outgoing(row: &OutboxMessage) -> Outgoing {
    Outgoing {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        body: Bytes::from(row.body.clone()),
        options: PublishOptions::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut b =
            RetryPolicy::new(Duration::from_millis(100), Duration::from_millis(350)).start();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        assert_eq!(b.next_delay(), Duration::from_millis(200));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
        assert_eq!(b.next_delay(), Duration::from_millis(350));
    }

    #[test]
    fn partition_by_failed_index() {
        let (ok, bad) = split_ids(&[10, 11, 12, 13], |i| i == 1 || i == 3);
        assert_eq!(ok, vec![10, 12]);
        assert_eq!(bad, vec![11, 13]);
    }
}
