//! `[retention]`: what the orchestrators' retention task deletes, and when.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::values::nz32;

/// What the retention task deletes, and when (SPEC §9, seed 004). One orchestrator at a
/// time runs it (a lease in the session store); every pass deletes in bounded batches, so
/// a backlog (a first start on an old database, a lowered window) drains over several
/// passes instead of holding the database in one long transaction.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Whether the task runs at all. Off, nothing is ever deleted.
    pub enabled: bool,
    /// How often a pass runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Most rows one delete statement removes (runs, for `run_results`).
    pub batch_size: NonZeroU32,
    /// Most batches of one kind a pass runs; what is left waits for the next pass.
    pub max_batches_per_pass: NonZeroU32,
    /// How long after a run ends its result items (and so its result body) are kept. Past
    /// it the run and its turn answer `expired: true` (`result_expired`); the run is never
    /// re-run.
    #[serde(with = "humantime_serde")]
    pub run_results: Duration,
    /// How long the event log keeps an event (idempotency keys of `POST /v1/events` are
    /// forgotten with it).
    #[serde(with = "humantime_serde")]
    pub event_log: Duration,
    /// How long the transcript (conversation history, history search) keeps an item.
    #[serde(with = "humantime_serde")]
    pub transcript: Duration,
    /// How long a published outbox row is kept after its publication.
    #[serde(with = "humantime_serde")]
    pub outbox_published: Duration,
    /// How long the turn identities (idempotency keys) of a closed session are kept after
    /// it was closed; a session that is not closed keeps them.
    #[serde(with = "humantime_serde")]
    pub closed_session_identities: Duration,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        Self {
            enabled: true,
            // Retention is not latency-sensitive; a minute keeps the task's load negligible.
            interval: Duration::from_secs(60),
            // Each batch is one short transaction; 500 is also the store's largest `IN` list.
            batch_size: nz32(500),
            // Up to 10 000 rows of each kind per pass: far above a steady state, while a
            // backlog cannot keep the database busy for long at a time.
            max_batches_per_pass: nz32(20),
            // Seed 004: result bodies and events are kept at most 24 hours.
            run_results: Duration::from_secs(DAY),
            // SPEC §9: event log and transcript 30 days.
            event_log: Duration::from_secs(30 * DAY),
            transcript: Duration::from_secs(30 * DAY),
            // Issue 14 groups published outbox rows with the event log.
            outbox_published: Duration::from_secs(30 * DAY),
            // Seed 004: identities of closed sessions go 7 days after the close.
            closed_session_identities: Duration::from_secs(7 * DAY),
        }
    }
}

impl RetentionConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let r = self;
        p.positive("retention.interval", r.interval);
        for (key, value) in [
            ("retention.run_results", r.run_results),
            ("retention.event_log", r.event_log),
            ("retention.transcript", r.transcript),
            ("retention.outbox_published", r.outbox_published),
            (
                "retention.closed_session_identities",
                r.closed_session_identities,
            ),
        ] {
            p.positive(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use std::time::Duration;

    #[test]
    fn retention_defaults_overrides_and_rejections() {
        let config = loader().load().unwrap();
        assert!(config.retention.enabled);
        assert_eq!(config.retention.run_results, Duration::from_secs(24 * 3600));
        assert_eq!(
            config.retention.closed_session_identities,
            Duration::from_secs(7 * 24 * 3600)
        );
        let config = loader()
            .env([("SWITCHBOARD__RETENTION__RUN_RESULTS", "2s")])
            .set("retention.event_log", "30d")
            .load()
            .unwrap();
        assert_eq!(config.retention.run_results, Duration::from_secs(2));
        assert_eq!(
            config.retention.event_log,
            Duration::from_secs(30 * 24 * 3600)
        );
        for key in [
            "retention.interval",
            "retention.run_results",
            "retention.event_log",
            "retention.transcript",
            "retention.outbox_published",
            "retention.closed_session_identities",
        ] {
            assert_rejected(key, "0s");
        }
        assert_load_error("retention.batch_size", "0");
        assert_load_error("retention.max_batches_per_pass", "0");
    }
}
