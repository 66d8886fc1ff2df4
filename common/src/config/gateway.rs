//! `[gateway]`: the HTTP gateway's listener, request bounds, outbox relay and key cache.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::values::{MIB, nz32, nzu};

/// The HTTP gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the HTTP API listens on, e.g. `0.0.0.0:8080`.
    pub http_addr: SocketAddr,
    /// Largest accepted request body in bytes; larger requests get `413 payload_too_large`
    /// before the body is buffered. Bigger files go through `POST /v1/artifacts`.
    pub max_body_bytes: NonZeroUsize,
    /// Time limit for one request (streams excluded), e.g. `30s`.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How often the outbox relay looks for events that were committed but not yet published
    /// (after a broker outage, or written by another gateway). Events ingested by this process
    /// are relayed immediately, not on this timer.
    #[serde(with = "humantime_serde")]
    pub outbox_poll_interval: Duration,
    /// Outbox rows published per relay round.
    pub outbox_batch: NonZeroU32,
    /// How long the outbox rows of an event ingested by this gateway stay leased to its own
    /// relay, which publishes them at once: the rows of a gateway that died right after the
    /// commit wait this long before another gateway's relay publishes them.
    #[serde(with = "humantime_serde")]
    pub outbox_handover_lease: Duration,
    /// How long published outbox rows wait to be marked, so that the rows of many relay
    /// rounds are marked in one statement. Must be shorter than `outbox_handover_lease`:
    /// until a row is marked, only its lease keeps other relays from publishing it again.
    #[serde(with = "humantime_serde")]
    pub outbox_mark_delay: Duration,
    /// API key lookups kept in memory (least recently used dropped first), so an
    /// authenticated request costs no database query; a revocation still takes effect on
    /// the next request on every gateway (see `sb_gateway::auth`).
    pub key_cache_entries: NonZeroUsize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            // Loopback: the embedded mode must not expose an API to the network by accident.
            http_addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            // The largest thing a JSON request legitimately carries is one inline artifact
            // (SPEC §13: 1 MiB).
            max_body_bytes: nzu(MIB),
            // Well above any non-streaming handler (they do a few DB queries), low enough that a
            // stuck dependency frees the connection.
            request_timeout: Duration::from_secs(30),
            // Only the recovery path waits for this timer; 500 ms bounds the extra latency after
            // an outage without polling the database hot.
            outbox_poll_interval: Duration::from_millis(500),
            // One round drains a typical backlog in a few confirms without a huge transaction.
            outbox_batch: nz32(100),
            // Short, since the rows are published at once; a crash right after a commit delays
            // that event's routing by this much.
            outbox_handover_lease: Duration::from_secs(5),
            // A twenty-fifth of the hand-over lease: at most a few marks a second.
            outbox_mark_delay: Duration::from_millis(200),
            // A few hundred bytes each: 10 000 keys cost a few MiB and cover any deployment
            // we know of; a miss is one indexed query.
            key_cache_entries: nzu(10_000),
        }
    }
}

impl GatewayConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let g = self;
        p.positive("gateway.request_timeout", g.request_timeout);
        p.positive("gateway.outbox_poll_interval", g.outbox_poll_interval);
        p.positive("gateway.outbox_handover_lease", g.outbox_handover_lease);
        p.positive("gateway.outbox_mark_delay", g.outbox_mark_delay);
        if g.outbox_mark_delay >= g.outbox_handover_lease {
            p.push(
                "gateway.outbox_mark_delay",
                "must be shorter than gateway.outbox_handover_lease",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    #[test]
    fn rejects_http_addr_that_does_not_parse() {
        assert_load_error("gateway.http_addr", "localhost");
    }

    #[test]
    fn rejects_zero_max_body_bytes() {
        assert_load_error("gateway.max_body_bytes", "0");
    }

    #[test]
    fn rejects_zero_request_timeout() {
        assert_rejected("gateway.request_timeout", "0s");
    }

    #[test]
    fn rejects_zero_outbox_poll_interval() {
        assert_rejected("gateway.outbox_poll_interval", "0ms");
    }

    #[test]
    fn rejects_zero_outbox_mark_delay() {
        assert_rejected("gateway.outbox_mark_delay", "0ms");
    }

    #[test]
    fn rejects_an_outbox_mark_delay_not_shorter_than_the_handover_lease() {
        assert_rejected("gateway.outbox_mark_delay", "5s");
    }

    #[test]
    fn rejects_zero_outbox_batch() {
        assert_load_error("gateway.outbox_batch", "0");
    }
}
