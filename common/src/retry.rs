//! The one retry policy of the workspace: exponential delays from the `backoff` crate.
//!
//! Every loop that waits before trying again — a claim while the ledger is down, a publish
//! while the broker is away, the outbox relay, reconnecting to the broker, a model call that
//! answered 429, the CLI following a stream — takes its delays from a [`Retry`] made by a
//! [`RetryPolicy`]. The numbers live in the configuration: [`RetryConfig`] (`[retry]`, re-exported
//! as `sb_common::config::RetryConfig`) for the roles' retries against their backends and the
//! broker, `providers.retry_backoff` for model calls. So one place decides how retries behave,
//! and the loops only decide *whether* to retry.
//!
//! The delays have no jitter: `initial`, then doubling, capped at `max`. The loops that retry
//! against a shared backend are few per process and already spread by their own start times,
//! and exact delays keep the policy testable.

use std::future::Future;
use std::time::Duration;

use backoff::backoff::Backoff as _;
use backoff::{ExponentialBackoff, ExponentialBackoffBuilder};
use serde::Deserialize;

/// The `[retry]` section of the configuration: how every role waits between attempts while
/// one of its backends (ledger database, session store, broker) is unreachable — claiming a
/// run, publishing results, relaying the outbox, routing an event, applying results,
/// reconnecting to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Delay before the first retry, e.g. `100ms`; every further one doubles it.
    #[serde(with = "humantime_serde")]
    pub initial: Duration,
    /// Longest delay between two attempts, e.g. `5s`: how late, at most, a loop notices that
    /// its backend is back.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            // Short enough that a blip (a failover, a restart) costs little latency …
            initial: Duration::from_millis(100),
            // … and bounded, so that work resumes within seconds of the backend returning.
            max: Duration::from_secs(5),
        }
    }
}

impl RetryConfig {
    /// The policy these numbers describe.
    #[must_use]
    pub fn policy(&self) -> RetryPolicy {
        RetryPolicy::new(self.initial, self.max)
    }
}

/// Exponential delays: `initial` before the first retry, doubled before every further one,
/// never longer than `max`. Retries never run out by time: the caller decides when to stop
/// (an attempt count, a deadline, shutdown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Delay before the first retry.
    pub initial: Duration,
    /// Longest delay between two attempts.
    pub max: Duration,
}

impl RetryPolicy {
    /// A policy starting at `initial`, never waiting longer than `max` (`max` below `initial`
    /// is raised to it).
    #[must_use]
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max }
    }

    /// The delays of one retry loop, starting at [`initial`](Self::initial).
    #[must_use]
    pub fn start(&self) -> Retry {
        Retry {
            backoff: ExponentialBackoffBuilder::new()
                .with_initial_interval(self.initial)
                .with_max_interval(self.max.max(self.initial))
                .with_multiplier(2.0)
                .with_randomization_factor(0.0)
                .with_max_elapsed_time(None)
                .build(),
            max: self.max.max(self.initial),
            attempts: 0,
        }
    }

    /// The delay before retry number `attempt` (0 = the first retry), for loops that count
    /// their attempts themselves.
    #[must_use]
    pub fn delay(&self, attempt: u32) -> Duration {
        let mut retry = self.start();
        // Past 64 doublings every delay is `max`.
        for _ in 0..attempt.min(64) {
            retry.next_delay();
        }
        retry.next_delay()
    }
}

/// The delays of one retry loop ([`RetryPolicy::start`]): each [`next_delay`](Self::next_delay)
/// counts an attempt and returns how long to wait before it.
#[derive(Debug)]
pub struct Retry {
    backoff: ExponentialBackoff,
    max: Duration,
    attempts: u32,
}

impl Retry {
    /// The delay before the next attempt (and counts the attempt).
    pub fn next_delay(&mut self) -> Duration {
        self.attempts = self.attempts.saturating_add(1);
        // Without a maximum elapsed time the crate always has a next delay.
        self.backoff.next_backoff().unwrap_or(self.max)
    }

    /// Attempts counted since the start or the last [`reset`](Self::reset).
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Progress was made: the next delay is `initial` again.
    pub fn reset(&mut self) {
        self.backoff.reset();
        self.attempts = 0;
    }

    /// Waits the next delay unless `stop` completes first. Returns `false` when stopped (the
    /// caller gives up), `true` when it is time for the next attempt.
    pub async fn wait(&mut self, stop: impl Future<Output = ()>) -> bool {
        let delay = self.next_delay();
        tokio::select! {
            biased;
            () = stop => false,
            () = tokio::time::sleep(delay) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delays_double_from_initial_and_stop_at_max() {
        let mut retry = RetryPolicy::new(ms(100), ms(350)).start();
        let delays: Vec<_> = (0..5).map(|_| retry.next_delay()).collect();
        assert_eq!(delays, [ms(100), ms(200), ms(350), ms(350), ms(350)]);
        assert_eq!(retry.attempts(), 5);
    }

    #[test]
    fn reset_starts_over() {
        let mut retry = RetryPolicy::new(ms(50), ms(5_000)).start();
        retry.next_delay();
        retry.next_delay();
        retry.reset();
        assert_eq!(retry.attempts(), 0);
        assert_eq!(retry.next_delay(), ms(50));
    }

    #[test]
    fn delay_by_attempt_matches_the_loop() {
        let policy = RetryPolicy::new(ms(100), Duration::from_secs(5));
        assert_eq!(policy.delay(0), ms(100));
        assert_eq!(policy.delay(3), ms(800));
        assert_eq!(policy.delay(10), Duration::from_secs(5));
        assert_eq!(policy.delay(u32::MAX), Duration::from_secs(5));
    }

    #[test]
    fn a_max_below_initial_is_raised_to_it() {
        let mut retry = RetryPolicy::new(ms(300), ms(100)).start();
        assert_eq!(retry.next_delay(), ms(300));
        assert_eq!(retry.next_delay(), ms(300));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_gives_up_when_stopped() {
        let mut retry = RetryPolicy::new(Duration::from_secs(60), Duration::from_secs(60)).start();
        assert!(!retry.wait(std::future::ready(())).await);
        assert!(retry.wait(std::future::pending()).await);
    }
}
