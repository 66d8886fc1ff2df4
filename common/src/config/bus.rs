//! `[bus]`: the message bus between the roles (in-process or RabbitMQ), its shard counts and
//! its queue settings.

use std::num::{NonZeroU16, NonZeroU32};

use serde::Deserialize;

use super::problems::Problems;
use super::secret_url::SecretUrl;
use super::values::{nz16, nz32};

/// Which bus implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BusKind {
    /// In-process bus: only for a single process (`switchboard dev`, tests).
    Memory,
    /// RabbitMQ (AMQP 0.9.1); required when roles run in separate processes.
    Amqp,
}

/// RabbitMQ queue type for durable queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// Replicated, and honours `x-delivery-limit` so poison messages are dead-lettered.
    Quorum,
    /// Single-node queues; lighter, for brokers without quorum-queue support.
    Classic,
}

/// The message bus.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusConfig {
    /// `memory` (single process) or `amqp` (RabbitMQ).
    pub kind: BusKind,
    /// Broker URL, required for `kind = "amqp"`: `amqp://user:password@host:5672/%2f`
    /// (`amqps://` for TLS).
    pub url: Option<SecretUrl>,
    /// Type of the durable queues (`quorum` or `classic`).
    pub queue_type: QueueType,
    /// How many times a message may be returned to its queue (nacked, or its consumer lost)
    /// before it is dead-lettered to `<name_prefix>.dead`: RabbitMQ's `x-delivery-limit`, so a
    /// message gets at most `delivery_limit + 1` delivery attempts (quorum queues, and the
    /// memory bus).
    pub delivery_limit: NonZeroU32,
    /// Number of event shards. Events of one conversation always land on the same shard, and
    /// each shard has a single active consumer, so this bounds how many orchestrators route in
    /// parallel; raise it only when one orchestrator no longer keeps up, since every extra
    /// shard splits the same load into smaller batches for the broker and the consumers.
    /// Every process of a deployment must use the same value; a lowered value is refused at
    /// startup while a shard queue above it still holds messages.
    pub events_shards: NonZeroU16,
    /// Number of result shards (by run id); same rules as `events_shards`.
    pub results_shards: NonZeroU16,
    /// Unacknowledged messages a consumer may hold (orchestrator and gateway consumers;
    /// workers use `worker.slots`).
    pub prefetch: NonZeroU16,
    /// Prefix of every exchange and queue name (`<prefix>.events`, …). Tests use a unique
    /// prefix to share one broker.
    pub name_prefix: String,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            // The default is the embedded mode; cluster deployments set `amqp`.
            kind: BusKind::Memory,
            url: None,
            // SPEC §3: quorum in cluster mode, because only quorum queues enforce a delivery
            // limit and survive a broker node loss.
            queue_type: QueueType::Quorum,
            // Enough for transient failures (a crashed consumer, a DB blip) to be retried, few
            // enough that a poison message is parked within seconds.
            delivery_limit: nz32(5),
            // One queue each: at most one orchestrator routes and one sinks at a time, and one
            // orchestrator keeps up with well over a thousand runs a second on one core. Each
            // shard is a queue of its own, so spreading the load over more of them leaves the
            // broker and the consumers smaller batches: on the 2-core benchmark, 8 shards cost
            // 4.7 ms of machine CPU per run against 2.9 ms for 1 (`docs/PERFORMANCE.md`).
            events_shards: nz16(1),
            results_shards: nz16(1),
            // Keeps a consumer busy across one round trip to the database without letting a
            // single process hoard a shard's backlog.
            prefetch: nz16(64),
            name_prefix: "switchboard".to_owned(),
        }
    }
}

impl BusConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let bus = self;
        match (&bus.url, bus.kind) {
            (Some(url), _) => p.url("bus.url", url, &["amqp", "amqps"], false),
            (None, BusKind::Amqp) => p.push("bus.url", "required when bus.kind is `amqp`"),
            (None, BusKind::Memory) => {}
        }
        // Dots are allowed (`test.abc`), but not at the ends: names are `<prefix>.<name>`.
        p.name("bus.name_prefix", &bus.name_prefix, &['.']);
        if bus.name_prefix.starts_with('.') || bus.name_prefix.ends_with('.') {
            p.push("bus.name_prefix", "expected no leading or trailing `.`");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    #[test]
    fn rejects_unknown_bus_kind() {
        assert_load_error("bus.kind", "kafka");
    }

    #[test]
    fn rejects_amqp_bus_without_url() {
        let problems = rejected("bus.kind", "amqp");
        assert_eq!(problems[0].key, "bus.url");
    }

    #[test]
    fn rejects_bus_url_with_wrong_scheme() {
        assert_rejected("bus.url", "http://guest:guest@localhost:5672");
    }

    #[test]
    fn rejects_unknown_queue_type() {
        assert_load_error("bus.queue_type", "stream");
    }

    #[test]
    fn rejects_zero_delivery_limit() {
        assert_load_error("bus.delivery_limit", "0");
    }

    #[test]
    fn rejects_zero_events_shards() {
        assert_load_error("bus.events_shards", "0");
    }

    #[test]
    fn rejects_zero_results_shards() {
        assert_load_error("bus.results_shards", "0");
    }

    #[test]
    fn rejects_zero_prefetch() {
        assert_load_error("bus.prefetch", "0");
    }

    #[test]
    fn rejects_name_prefix_with_wildcards() {
        assert_rejected("bus.name_prefix", "switch#board");
    }

    #[test]
    fn rejects_name_prefix_with_trailing_dot() {
        assert_rejected("bus.name_prefix", "switchboard.");
    }
}
