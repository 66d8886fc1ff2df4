//! The retention task: deletes what the host no longer keeps (SPEC §9, seed 004), in
//! bounded batches, and counts it (`sb_retention_deleted_total{kind}`).
//!
//! | kind | deleted | when |
//! | --- | --- | --- |
//! | `run_results` | a run's result items (its result body with them); the run is marked `events_expired_at` | `retention.run_results` after the run ended |
//! | `artifacts` | artifacts and their bytes | at their `expires_at` |
//! | `outbox` | published outbox rows | `retention.outbox_published` after publication |
//! | `event_log` | host events (and with them the idempotency keys of `POST /v1/events`) | `retention.event_log` after receipt |
//! | `transcript` | conversation items (history, history search) | `retention.transcript` after they were written |
//! | `turn_identities` | the turn identities (idempotency keys) of a closed session | `retention.closed_session_identities` after the close |
//!
//! A run whose items are gone stays in the ledger with its status, usage and failure: its
//! snapshot answers `expired: true` (a completed turn `result_expired`) and nothing re-runs
//! it, since the turn identity that would answer a retry outlives the result (7 days after
//! the session closes, against 24 hours after the run ends).
//!
//! # One orchestrator at a time
//!
//! Every orchestrator runs the task, but a pass starts only for the holder of the lease
//! [`LEASE_KEY`] in the session store (taken with the orchestrator's member id, kept by
//! taking it again at every pass, so the same one keeps doing it; when it dies, the lease
//! expires after [`lease_ttl`] and another takes over). The deletes are idempotent, so two
//! passes at once would be correct — but each would scan the same rows, contend for the
//! same row locks (and on SQLite for the one write lock) and count the same runs twice; the
//! lease makes that cost nobody's. When the session store cannot be reached the pass is
//! skipped: retention is never urgent.
//!
//! # Bounded batches
//!
//! One delete statement removes at most `retention.batch_size` rows, in its own short
//! transaction, and a pass runs at most `retention.max_batches_per_pass` of them per kind:
//! a backlog (a first start on an old database, a window just shortened) drains over
//! several passes instead of holding locks for minutes. [`drain`] is that loop, apart from
//! the store.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sb_common::config::RetentionConfig;
use sb_common::session::SessionStore;
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_store::Stores;

use crate::error::Result;

/// The session-store lease that elects the one orchestrator doing retention.
pub const LEASE_KEY: &str = "retention";

/// One kind of data the task deletes (the metric's `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetentionKind {
    /// Result items of ended runs.
    RunResults,
    /// Expired artifacts.
    Artifacts,
    /// Published outbox rows.
    Outbox,
    /// The event log.
    EventLog,
    /// The transcript.
    Transcript,
    /// Turn identities of closed sessions.
    TurnIdentities,
}

impl RetentionKind {
    /// Every kind, in the order a pass handles them.
    pub const ALL: [Self; 6] = [
        Self::RunResults,
        Self::Artifacts,
        Self::Outbox,
        Self::EventLog,
        Self::Transcript,
        Self::TurnIdentities,
    ];

    /// The metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RunResults => "run_results",
            Self::Artifacts => "artifacts",
            Self::Outbox => "outbox",
            Self::EventLog => "event_log",
            Self::Transcript => "transcript",
            Self::TurnIdentities => "turn_identities",
        }
    }
}

/// How long each kind is kept, and the batch bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Whether the task runs.
    pub enabled: bool,
    /// Time between passes.
    pub interval: Duration,
    /// Rows per delete statement.
    pub batch_size: u64,
    /// Batches per kind per pass.
    pub max_batches_per_pass: u32,
    /// Result items, after the run ended.
    pub run_results: Duration,
    /// Event log, after receipt.
    pub event_log: Duration,
    /// Transcript, after writing.
    pub transcript: Duration,
    /// Outbox rows, after publication.
    pub outbox_published: Duration,
    /// Turn identities, after their session closed.
    pub closed_session_identities: Duration,
}

impl RetentionPolicy {
    /// The policy of the validated `[retention]` section.
    #[must_use]
    pub fn from_config(config: &RetentionConfig) -> Self {
        Self {
            enabled: config.enabled,
            interval: config.interval,
            batch_size: u64::from(config.batch_size.get()),
            max_batches_per_pass: config.max_batches_per_pass.get(),
            run_results: config.run_results,
            event_log: config.event_log,
            transcript: config.transcript,
            outbox_published: config.outbox_published,
            closed_session_identities: config.closed_session_identities,
        }
    }

    /// What of `kind` is deleted at `now`: everything strictly older than the returned
    /// instant (artifacts: whose `expires_at` is at or before it). Pure.
    #[must_use]
    pub fn cutoff(&self, kind: RetentionKind, now: DateTime<Utc>) -> DateTime<Utc> {
        let keep = match kind {
            RetentionKind::Artifacts => return now,
            RetentionKind::RunResults => self.run_results,
            RetentionKind::Outbox => self.outbox_published,
            RetentionKind::EventLog => self.event_log,
            RetentionKind::Transcript => self.transcript,
            RetentionKind::TurnIdentities => self.closed_session_identities,
        };
        // A window too large for chrono keeps everything.
        chrono::Duration::from_std(keep)
            .ok()
            .and_then(|keep| now.checked_sub_signed(keep))
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        Self::from_config(&RetentionConfig::default())
    }
}

/// How long the retention lease lives without renewal: three intervals, so a pass that runs
/// late does not lose it, and at least 30 s, so a short test interval does not make the
/// holder flap.
#[must_use]
pub fn lease_ttl(interval: Duration) -> Duration {
    interval.saturating_mul(3).max(Duration::from_secs(30))
}

/// Runs `batch` (one bounded delete returning how many rows it removed) until it removes
/// fewer than `batch_size` rows or `max_batches` ran. Returns the total removed.
pub async fn drain<F, Fut>(batch_size: u64, max_batches: u32, mut batch: F) -> Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    let mut total = 0;
    for _ in 0..max_batches {
        let removed = batch().await?;
        total += removed;
        if removed < batch_size {
            break;
        }
    }
    Ok(total)
}

/// What one pass deleted, per kind (zero kinds included).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// `(kind, rows)` in [`RetentionKind::ALL`] order.
    pub deleted: Vec<(RetentionKind, u64)>,
}

impl RetentionReport {
    /// Rows of `kind` deleted.
    #[must_use]
    pub fn of(&self, kind: RetentionKind) -> u64 {
        self.deleted
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

/// The retention task of one orchestrator.
pub struct Retention {
    stores: Stores,
    sessions: Arc<dyn SessionStore>,
    policy: RetentionPolicy,
    /// This orchestrator's member id: the lease holder.
    holder: String,
}

impl std::fmt::Debug for Retention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retention")
            .field("policy", &self.policy)
            .field("holder", &self.holder)
            .finish_non_exhaustive()
    }
}

impl Retention {
    /// The task of orchestrator `holder`.
    #[must_use]
    pub fn new(
        stores: Stores,
        sessions: Arc<dyn SessionStore>,
        policy: RetentionPolicy,
        holder: impl Into<String>,
    ) -> Self {
        Self {
            stores,
            sessions,
            policy,
            holder: holder.into(),
        }
    }

    /// One pass at `now` if this orchestrator holds (or takes) the lease; `None` when another
    /// one holds it. Every deleted row is counted in `sb_retention_deleted_total`.
    pub async fn pass(&self, now: DateTime<Utc>) -> Result<Option<RetentionReport>> {
        let ttl = lease_ttl(self.policy.interval);
        if !self
            .sessions
            .acquire_lease(LEASE_KEY, &self.holder, ttl)
            .await?
        {
            return Ok(None);
        }
        let mut report = RetentionReport::default();
        for kind in RetentionKind::ALL {
            let cutoff = self.policy.cutoff(kind, now);
            let deleted = drain(
                self.policy.batch_size,
                self.policy.max_batches_per_pass,
                || self.delete_batch(kind, cutoff),
            )
            .await?;
            if deleted > 0 {
                Metrics::global().add(
                    names::RETENTION_DELETED_TOTAL,
                    &[("kind", kind.as_str())],
                    deleted,
                );
                tracing::info!(kind = kind.as_str(), deleted, %cutoff, "retention deleted");
            }
            report.deleted.push((kind, deleted));
        }
        Ok(Some(report))
    }

    /// One bounded delete of `kind` older than `cutoff`.
    async fn delete_batch(&self, kind: RetentionKind, cutoff: DateTime<Utc>) -> Result<u64> {
        let batch = self.policy.batch_size;
        let s = &self.stores;
        Ok(match kind {
            RetentionKind::RunResults => s.runs.expire_events(cutoff, batch).await?,
            RetentionKind::Artifacts => s.artifacts.delete_expired(cutoff, batch).await?,
            RetentionKind::Outbox => s.outbox.delete_published_before(cutoff, batch).await?,
            RetentionKind::EventLog => s.events.delete_older_than(cutoff, batch).await?,
            RetentionKind::Transcript => s.transcript.delete_older_than(cutoff, batch).await?,
            RetentionKind::TurnIdentities => {
                s.turns.delete_closed_identities(cutoff, batch).await?
            }
        })
    }

    /// A pass every `retention.interval` until shutdown (none when disabled).
    pub async fn run(self, shutdown: Shutdown) {
        if !self.policy.enabled {
            tracing::info!("retention disabled; nothing is ever deleted");
            return;
        }
        shutdown
            .every(self.policy.interval, || async {
                if let Err(error) = self.pass(Utc::now()).await {
                    tracing::warn!(%error, "retention pass failed; retrying at the next tick");
                }
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn cutoffs_follow_the_policy() {
        let policy = RetentionPolicy::default();
        let now = Utc::now();
        let day = chrono::Duration::days(1);
        assert_eq!(policy.cutoff(RetentionKind::RunResults, now), now - day);
        assert_eq!(policy.cutoff(RetentionKind::EventLog, now), now - day * 30);
        assert_eq!(
            policy.cutoff(RetentionKind::Transcript, now),
            now - day * 30
        );
        assert_eq!(policy.cutoff(RetentionKind::Outbox, now), now - day * 30);
        assert_eq!(
            policy.cutoff(RetentionKind::TurnIdentities, now),
            now - day * 7
        );
        assert_eq!(policy.cutoff(RetentionKind::Artifacts, now), now);
        let forever = RetentionPolicy {
            event_log: Duration::MAX,
            ..RetentionPolicy::default()
        };
        assert_eq!(
            forever.cutoff(RetentionKind::EventLog, now),
            DateTime::<Utc>::MIN_UTC
        );
    }

    #[test]
    fn the_lease_outlives_a_late_pass() {
        assert_eq!(lease_ttl(Duration::from_secs(60)), Duration::from_secs(180));
        assert_eq!(
            lease_ttl(Duration::from_millis(100)),
            Duration::from_secs(30)
        );
    }

    #[tokio::test]
    async fn drain_stops_at_a_short_batch_or_the_bound() {
        // A backlog of 25 rows in batches of 10: 10, 10, 5, done.
        let left = Mutex::new(25u64);
        let take = || async {
            let mut left = left.lock().unwrap();
            let n = (*left).min(10);
            *left -= n;
            Ok(n)
        };
        assert_eq!(drain(10, 100, take).await.unwrap(), 25);
        assert_eq!(*left.lock().unwrap(), 0);

        // Bounded: two batches of a larger backlog, the rest for the next pass.
        *left.lock().unwrap() = 100;
        assert_eq!(drain(10, 2, take).await.unwrap(), 20);
        assert_eq!(*left.lock().unwrap(), 80);
    }
}
