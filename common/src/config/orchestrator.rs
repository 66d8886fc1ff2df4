//! `[orchestrator]`: run timeouts, the reaper and scheduler periods, membership and the
//! route cache.

use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;

/// The orchestrator.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrchestratorConfig {
    /// Run timeout used when the agent's `runner_config.timeout` is absent, e.g. `300s`.
    #[serde(with = "humantime_serde")]
    pub default_run_timeout: Duration,
    /// Extra time the reaper gives a run past its deadline, or a worker past its lease expiry,
    /// before finalizing the run itself (`timeout` / `interrupted`). It covers the worker's own
    /// cancel grace and the result's trip through the bus.
    #[serde(with = "humantime_serde")]
    pub lease_grace: Duration,
    /// How often the reaper scans for overdue runs and expired leases.
    #[serde(with = "humantime_serde")]
    pub reaper_interval: Duration,
    /// How often the scheduler looks for due schedules and fires them: a schedule fires up
    /// to this long after its time.
    #[serde(with = "humantime_serde")]
    pub scheduler_interval: Duration,
    /// How often an orchestrator renews its entry in the member registry and rebalances the
    /// event and result shards; a joining orchestrator gets its share within this long.
    #[serde(with = "humantime_serde")]
    pub membership_heartbeat: Duration,
    /// How long an orchestrator stays a member after its last renewal: the shards of one
    /// that died move to the others within this plus one heartbeat. Must exceed
    /// `membership_heartbeat`.
    #[serde(with = "humantime_serde")]
    pub membership_ttl: Duration,
    /// This orchestrator's id in the member registry. Unset: unique per process start.
    /// Two running orchestrators must never share an id.
    pub member_id: Option<String>,
    /// Longest the orchestrator routes with a cached read of a workspace's agents or a
    /// runner's descriptor. Changes through the API and worker registrations reach every
    /// orchestrator at once (they announce a new routing epoch); this bounds only changes
    /// made directly in the database. `0s` turns the cache off.
    #[serde(with = "humantime_serde")]
    pub route_cache_max_age: Duration,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            // Seed host behaviour: `DEFAULT_RUNNER_TIMEOUT_SECONDS = 300`.
            default_run_timeout: Duration::from_secs(300),
            // Worker cancel grace (5 s) plus a generous margin for publish + sink.
            lease_grace: Duration::from_secs(15),
            // A stuck run is noticed within deadline + grace + 5 s; the scan is one indexed query.
            reaper_interval: Duration::from_secs(5),
            // Schedules fire within a second of their time; the scan is one indexed query.
            scheduler_interval: Duration::from_secs(1),
            // Two missed renewals are tolerated before a member is presumed dead.
            membership_heartbeat: Duration::from_secs(2),
            membership_ttl: Duration::from_secs(6),
            member_id: None,
            // Routing reads agents and runners on every event; they change rarely.
            route_cache_max_age: Duration::from_secs(30),
        }
    }
}

impl OrchestratorConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let o = self;
        p.positive("orchestrator.default_run_timeout", o.default_run_timeout);
        p.positive("orchestrator.lease_grace", o.lease_grace);
        p.positive("orchestrator.reaper_interval", o.reaper_interval);
        p.positive("orchestrator.scheduler_interval", o.scheduler_interval);
        p.positive("orchestrator.membership_heartbeat", o.membership_heartbeat);
        if o.membership_ttl <= o.membership_heartbeat {
            p.push(
                "orchestrator.membership_ttl",
                "expected a duration greater than orchestrator.membership_heartbeat",
            );
        }
        if let Some(id) = &o.member_id {
            p.name("orchestrator.member_id", id, &['.', ':']);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::test_support::*;

    #[test]
    fn rejects_zero_default_run_timeout() {
        assert_rejected("orchestrator.default_run_timeout", "0s");
    }

    #[test]
    fn rejects_zero_lease_grace() {
        assert_rejected("orchestrator.lease_grace", "0s");
    }

    #[test]
    fn rejects_a_membership_ttl_not_above_the_heartbeat() {
        assert_rejected("orchestrator.membership_ttl", "2s");
        assert_rejected("orchestrator.membership_heartbeat", "0s");
    }

    #[test]
    fn rejects_zero_reaper_interval() {
        assert_rejected("orchestrator.reaper_interval", "0s");
    }

    #[test]
    fn scheduler_interval_defaults_to_a_second_and_must_be_positive() {
        let config = loader().load().unwrap();
        assert_eq!(
            config.orchestrator.scheduler_interval,
            Duration::from_secs(1)
        );
        let config = loader()
            .set("orchestrator.scheduler_interval", "250ms")
            .load()
            .unwrap();
        assert_eq!(
            config.orchestrator.scheduler_interval,
            Duration::from_millis(250)
        );
        assert_rejected("orchestrator.scheduler_interval", "0s");
        assert_load_error("orchestrator.scheduler_interval", "often");
    }
}
