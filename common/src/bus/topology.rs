//! Every exchange, queue and routing-key name of the bus (SPEC §3), in one place.
//!
//! | exchange (type) | routing key | queue(s) |
//! | --- | --- | --- |
//! | `switchboard.events` (direct) | `shard.<k>` | `switchboard.events.<k>`, single active consumer |
//! | `switchboard.runs` (direct) | `<pool>` | `switchboard.runs.<pool>` |
//! | `switchboard.results` (direct) | `shard.<k>` | `switchboard.results.<k>`, single active consumer |
//! | `switchboard.deliveries` (topic) | `<workspace>.<conversation or _>.<run_id>` | one exclusive queue per gateway |
//! | `switchboard.control` (topic) | `cancel.<run_id>` | one exclusive queue per worker |
//! | `switchboard.dead` (fanout) | — | `switchboard.dead` |
//!
//! The table shows the default [`TopologyOptions::name_prefix`], `switchboard`: every name is
//! `<name_prefix>.<suffix>`, so tests (`test-<uuid>.switchboard`) and several deployments can
//! share one broker without seeing each other's messages.
//!
//! Sharding: events of one conversation always go to one shard, so a single active consumer
//! per shard sees them in order; results of one run always go to one shard for the same
//! reason. The shard is `fnv1a(key) % shards` with 64-bit FNV-1a over the UTF-8 bytes, which is
//! stable across processes, versions and platforms (unlike `std`'s hasher). Changing a shard
//! count re-maps keys: drain the queues first. A lowered count is checked at startup
//! ([`retire_surplus_shards`]): the queues above it are deleted when empty, and a process
//! refuses to start while one still holds messages or a consumer.

use std::num::NonZeroU32;

use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::messages::{EventMessage, encode};

use super::{Bus, BusError, ExchangeKind, ExchangeSpec, QueueSpec, QueueType, Result};

/// A message addressed on the bus: what to publish, or to enqueue in the outbox for the
/// relay to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// Exchange to publish to.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Message body (JSON bytes).
    pub body: Vec<u8>,
}

/// Default name prefix (SPEC §3 names).
pub const DEFAULT_NAME_PREFIX: &str = "switchboard";
/// Suffix of the events exchange.
pub const EVENTS: &str = "events";
/// Suffix of the run-jobs exchange.
pub const RUNS: &str = "runs";
/// Suffix of the results exchange.
pub const RESULTS: &str = "results";
/// Suffix of the live-deliveries exchange.
pub const DELIVERIES: &str = "deliveries";
/// Suffix of the control (cancel) exchange.
pub const CONTROL: &str = "control";
/// Suffix of the dead-letter exchange and of its queue.
pub const DEAD: &str = "dead";

/// Stable 64-bit FNV-1a hash (the sharding function; never change it).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(PRIME))
}

/// Events shard of a conversation: `fnv1a(workspace + "\0" + conversation) % shards`; a
/// missing conversation hashes as the empty string.
pub fn events_shard(workspace: &str, conversation: Option<&str>, shards: NonZeroU32) -> u32 {
    let mut key = Vec::with_capacity(workspace.len() + 1 + conversation.map_or(0, str::len));
    key.extend_from_slice(workspace.as_bytes());
    key.push(0);
    key.extend_from_slice(conversation.unwrap_or("").as_bytes());
    (fnv1a(&key) % u64::from(shards.get())) as u32
}

/// Ordering lane of an event ([`EventMessage::lane`]): `fnv1a(workspace + "\0" +
/// conversation)`, the key its shard is taken from, so the events of one conversation share
/// a lane; an event without a conversation (none or empty) has a lane of its own,
/// `fnv1a(event_id as text)`. Two conversations that collide share a lane and are routed one
/// after the other, as they would be without lanes.
pub fn event_lane(workspace: &str, event_id: EventId, conversation: Option<&str>) -> u64 {
    match conversation.filter(|c| !c.is_empty()) {
        Some(conversation) => {
            let mut key = Vec::with_capacity(workspace.len() + 1 + conversation.len());
            key.extend_from_slice(workspace.as_bytes());
            key.push(0);
            key.extend_from_slice(conversation.as_bytes());
            fnv1a(&key)
        }
        None => fnv1a(event_id.to_string().as_bytes()),
    }
}

/// Results shard of a run: `fnv1a(run_id as text) % shards`.
pub fn results_shard(run_id: &RunId, shards: NonZeroU32) -> u32 {
    (fnv1a(run_id.to_string().as_bytes()) % u64::from(shards.get())) as u32
}

/// Routing key of a shard: `shard.<k>`.
pub fn shard_routing_key(shard: u32) -> String {
    format!("shard.{shard}")
}

/// Routing key of an event on the events exchange.
pub fn events_routing_key(
    workspace: &str,
    conversation: Option<&str>,
    shards: NonZeroU32,
) -> String {
    shard_routing_key(events_shard(workspace, conversation, shards))
}

/// Routing key of a result on the results exchange.
pub fn results_routing_key(run_id: &RunId, shards: NonZeroU32) -> String {
    shard_routing_key(results_shard(run_id, shards))
}

/// Routing key of a run job on the runs exchange: the pool name.
pub fn runs_routing_key(pool: &str) -> String {
    pool.to_owned()
}

/// Longest word [`key_segment`] makes, in bytes. A live-delivery key has two free-text words
/// and a run id (36 bytes) between two dots: `2 × 96 + 38 = 230`, under AMQP's 255-byte limit
/// on routing keys (a short string, which an AMQP client cannot send longer), whatever the
/// workspace and conversation ids are.
pub const MAX_KEY_SEGMENT_BYTES: usize = 96;

/// A routing-key word made from free text: `.`, `*` and `#` (the topic syntax) become `_`, and
/// an empty word becomes `_`. A word longer than [`MAX_KEY_SEGMENT_BYTES`] keeps a readable
/// prefix (cut at a character boundary) followed by `~` and the 16 hex digits of the
/// [`fnv1a`] hash of the *whole* original text, so it is at most
/// [`MAX_KEY_SEGMENT_BYTES`] long and two long ids sharing a prefix still differ.
///
/// The publisher (the result sink) and the binder (the gateway's live hub) both build keys
/// with this one function, so they always agree. A word does not identify its text uniquely
/// (`a.b` and `a_b` give the same word, and so may two hashed ids): the key only narrows
/// which gateway queue gets an item, and every stream filters the items it receives by run
/// id.
pub fn key_segment(text: &str) -> String {
    if text.is_empty() {
        return "_".into();
    }
    let escaped: String = text
        .chars()
        .map(|c| if matches!(c, '.' | '*' | '#') { '_' } else { c })
        .collect();
    if escaped.len() <= MAX_KEY_SEGMENT_BYTES {
        return escaped;
    }
    // `~` + 16 hex digits.
    const SUFFIX: usize = 17;
    let mut cut = MAX_KEY_SEGMENT_BYTES - SUFFIX;
    while !escaped.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}~{:016x}", &escaped[..cut], fnv1a(text.as_bytes()))
}

/// Routing key of a live delivery: `<workspace>.<conversation or _>.<run_id>`.
pub fn deliveries_routing_key(
    workspace: &str,
    conversation: Option<&str>,
    run_id: &RunId,
) -> String {
    format!(
        "{}.{}.{run_id}",
        key_segment(workspace),
        conversation.map_or_else(|| "_".into(), key_segment)
    )
}

/// Binding pattern for every delivery of one run: `*.*.<run_id>`.
pub fn deliveries_run_pattern(run_id: &RunId) -> String {
    format!("*.*.{run_id}")
}

/// Binding pattern for every delivery of one conversation: `<workspace>.<conversation>.*`.
pub fn deliveries_conversation_pattern(workspace: &str, conversation: Option<&str>) -> String {
    format!(
        "{}.{}.*",
        key_segment(workspace),
        conversation.map_or_else(|| "_".into(), key_segment)
    )
}

/// Routing key (and binding key) of a run's cancel message: `cancel.<run_id>`.
pub fn control_routing_key(run_id: &RunId) -> String {
    format!("cancel.{run_id}")
}

/// Binding pattern for every cancel message: `cancel.*`.
pub const CONTROL_ALL_PATTERN: &str = "cancel.*";

/// Everything that shapes the declared topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyOptions {
    /// Every exchange and queue is named `<name_prefix>.<suffix>`; `switchboard` by default,
    /// `test-<uuid>.switchboard` in tests. No leading or trailing dot.
    pub name_prefix: String,
    /// Number of events shards (queues `switchboard.events.<k>`).
    pub events_shards: NonZeroU32,
    /// Number of results shards (queues `switchboard.results.<k>`).
    pub results_shards: NonZeroU32,
    /// Worker pools: one `switchboard.runs.<pool>` queue each.
    pub pools: Vec<String>,
    /// Type of the durable queues.
    pub queue_type: QueueType,
    /// RabbitMQ `x-delivery-limit` of the durable queues: how many times a message may be
    /// *returned* (nacked with requeue, or its consumer lost) before it is dead-lettered, so
    /// it is attempted at most `delivery_limit + 1` times. Quorum queues only.
    pub delivery_limit: Option<u32>,
}

impl Default for TopologyOptions {
    fn default() -> Self {
        Self {
            name_prefix: DEFAULT_NAME_PREFIX.into(),
            // As the configuration's default (`bus.events_shards`, `bus.results_shards`).
            events_shards: NonZeroU32::MIN,
            results_shards: NonZeroU32::MIN,
            pools: vec!["default".into()],
            queue_type: QueueType::Quorum,
            // A few returns ride over a crashed consumer or a database blip; a poison message
            // is parked within seconds.
            delivery_limit: Some(5),
        }
    }
}

/// The names and queue specs of one deployment's topology (prefix and shard counts applied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    options: TopologyOptions,
}

impl Topology {
    /// Validates the options (pool names are routing keys and queue-name suffixes).
    pub fn new(options: TopologyOptions) -> Result<Self> {
        let prefix = &options.name_prefix;
        if prefix.is_empty()
            || prefix.starts_with('.')
            || prefix.ends_with('.')
            || prefix.contains(['*', '#'])
        {
            return Err(BusError::InvalidArgument(format!(
                "name prefix {prefix:?} must be non-empty, without leading or trailing dot, without * or #"
            )));
        }
        if options.pools.is_empty() {
            return Err(BusError::InvalidArgument(
                "at least one worker pool is required".into(),
            ));
        }
        for pool in &options.pools {
            let ok = !pool.is_empty()
                && pool.len() <= 64
                && pool
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !ok {
                return Err(BusError::InvalidArgument(format!(
                    "pool name {pool:?} must be 1-64 characters of [A-Za-z0-9_-]"
                )));
            }
        }
        Ok(Self { options })
    }

    /// The options this topology was built from.
    pub fn options(&self) -> &TopologyOptions {
        &self.options
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.options.name_prefix)
    }

    /// `<prefix>.events`
    pub fn events_exchange(&self) -> String {
        self.name(EVENTS)
    }
    /// `<prefix>.runs`
    pub fn runs_exchange(&self) -> String {
        self.name(RUNS)
    }
    /// `<prefix>.results`
    pub fn results_exchange(&self) -> String {
        self.name(RESULTS)
    }
    /// `<prefix>.deliveries`
    pub fn deliveries_exchange(&self) -> String {
        self.name(DELIVERIES)
    }
    /// `<prefix>.control`
    pub fn control_exchange(&self) -> String {
        self.name(CONTROL)
    }
    /// `<prefix>.dead`
    pub fn dead_exchange(&self) -> String {
        self.name(DEAD)
    }

    /// Every exchange with its type.
    pub fn exchanges(&self) -> Vec<ExchangeSpec> {
        vec![
            ExchangeSpec::new(self.events_exchange(), ExchangeKind::Direct),
            ExchangeSpec::new(self.runs_exchange(), ExchangeKind::Direct),
            ExchangeSpec::new(self.results_exchange(), ExchangeKind::Direct),
            ExchangeSpec::new(self.deliveries_exchange(), ExchangeKind::Topic),
            ExchangeSpec::new(self.control_exchange(), ExchangeKind::Topic),
            ExchangeSpec::new(self.dead_exchange(), ExchangeKind::Fanout),
        ]
    }

    fn work_queue(&self, name: String, exchange: String, key: String) -> QueueSpec {
        QueueSpec {
            name,
            bindings: vec![super::Binding::new(exchange, key)],
            kind: super::QueueKind::Durable,
            single_active_consumer: false,
            queue_type: self.options.queue_type,
            delivery_limit: self.options.delivery_limit,
            dead_letter_exchange: Some(self.dead_exchange()),
        }
    }

    /// Routing key of an event with this topology's shard count.
    pub fn events_routing_key(&self, workspace: &str, conversation: Option<&str>) -> String {
        events_routing_key(workspace, conversation, self.options.events_shards)
    }

    /// The message announcing an accepted event on the events exchange, sharded by its
    /// conversation: what ingest enqueues in the outbox with every event it accepts (the
    /// gateway's `POST /v1/events` and turns, a schedule's firing), and what publishes an
    /// event again (a released parked event, embedded mode's recovery). One function, so
    /// an event is always announced on the shard its conversation's events are consumed on.
    #[must_use]
    pub fn event_announcement(
        &self,
        workspace: &WorkspaceId,
        event_id: EventId,
        conversation: Option<&str>,
    ) -> Announcement {
        let message = EventMessage::new(workspace.clone(), event_id).in_lane(event_lane(
            workspace.as_str(),
            event_id,
            conversation,
        ));
        Announcement {
            exchange: self.events_exchange(),
            routing_key: self.events_routing_key(workspace.as_str(), conversation),
            body: encode(&message),
        }
    }

    /// Routing key of a result with this topology's shard count.
    pub fn results_routing_key(&self, run_id: &RunId) -> String {
        results_routing_key(run_id, self.options.results_shards)
    }

    /// Events shard queue `k`: single active consumer (per-conversation order).
    pub fn events_queue(&self, shard: u32) -> QueueSpec {
        let mut spec = self.work_queue(
            format!("{}.{shard}", self.events_exchange()),
            self.events_exchange(),
            shard_routing_key(shard),
        );
        spec.single_active_consumer = true;
        spec
    }

    /// Results shard queue `k`: single active consumer (per-run order).
    pub fn results_queue(&self, shard: u32) -> QueueSpec {
        let mut spec = self.work_queue(
            format!("{}.{shard}", self.results_exchange()),
            self.results_exchange(),
            shard_routing_key(shard),
        );
        spec.single_active_consumer = true;
        spec
    }

    /// Job queue of a worker pool, shared by its workers.
    pub fn runs_queue(&self, pool: &str) -> QueueSpec {
        self.work_queue(
            format!("{}.{pool}", self.runs_exchange()),
            self.runs_exchange(),
            runs_routing_key(pool),
        )
    }

    /// The dead-letter queue (bound to the fanout dead exchange; no limit, no dead-lettering).
    pub fn dead_queue(&self) -> QueueSpec {
        QueueSpec::durable(self.name(DEAD))
            .queue_type(self.options.queue_type)
            .bind(self.dead_exchange(), "")
    }

    /// A gateway's exclusive live-delivery queue (bind per streamed run with
    /// [`deliveries_run_pattern`]).
    pub fn deliveries_queue(&self, gateway_id: &str) -> QueueSpec {
        QueueSpec::exclusive(format!(
            "{}.{}",
            self.deliveries_exchange(),
            key_segment(gateway_id)
        ))
    }

    /// A worker's exclusive control queue (bind per held run with [`control_routing_key`]).
    pub fn control_queue(&self, worker_id: &str) -> QueueSpec {
        QueueSpec::exclusive(format!(
            "{}.{}",
            self.control_exchange(),
            key_segment(worker_id)
        ))
    }

    /// Every durable queue: events and results shards, one runs queue per pool, the dead queue.
    pub fn durable_queues(&self) -> Vec<QueueSpec> {
        let mut queues = vec![self.dead_queue()];
        queues.extend((0..self.options.events_shards.get()).map(|k| self.events_queue(k)));
        queues.extend((0..self.options.results_shards.get()).map(|k| self.results_queue(k)));
        queues.extend(self.options.pools.iter().map(|p| self.runs_queue(p)));
        queues
    }

    /// Deletes every exchange and durable queue of this topology, with their messages (test
    /// teardown; `switchboard dlq purge` only empties the dead queue).
    pub async fn delete(&self, bus: &dyn Bus) -> Result<()> {
        for queue in self.durable_queues() {
            bus.delete_queue(&queue.name).await?;
        }
        for exchange in self.exchanges() {
            bus.delete_exchange(&exchange.name).await?;
        }
        Ok(())
    }
}

/// Declares every exchange and durable queue of the topology, and retires the shard queues a
/// lowered shard count left behind ([`retire_surplus_shards`]). Idempotent; run at startup by
/// every role (the AMQP backend re-declares what it declared after a reconnection).
pub async fn declare_topology(bus: &dyn Bus, options: &TopologyOptions) -> Result<Topology> {
    let topology = Topology::new(options.clone())?;
    for exchange in topology.exchanges() {
        bus.declare_exchange(&exchange).await?;
    }
    for queue in topology.durable_queues() {
        bus.declare_queue(&queue).await?;
    }
    retire_surplus_shards(bus, &topology).await?;
    Ok(topology)
}

/// Deletes the shard queues above the shard counts (`<prefix>.events.<k>` for
/// `k ≥ events_shards`, and the same for results): nothing consumes them any more, and
/// nothing is published to them. When one of them is still in use — messages wait in it,
/// which would never be routed or applied, or a process with the former count consumes it —
/// nothing is deleted and the call fails with [`BusError::DeclarationConflict`] naming it, so
/// the process refuses to start instead of stranding accepted work.
///
/// Shard queues are numbered from 0 without gaps, so the scan stops at the first missing
/// number; the surplus is deleted from the highest number down, so an interrupted pass leaves
/// no gap either.
pub async fn retire_surplus_shards(bus: &dyn Bus, topology: &Topology) -> Result<()> {
    let options = topology.options();
    /// A shard queue of one family, by number.
    type ShardQueue = fn(&Topology, u32) -> QueueSpec;
    let families: [(&str, u32, ShardQueue); 2] = [
        (
            "bus.events_shards",
            options.events_shards.get(),
            Topology::events_queue,
        ),
        (
            "bus.results_shards",
            options.results_shards.get(),
            Topology::results_queue,
        ),
    ];
    for (setting, count, queue_of) in families {
        let mut surplus = Vec::new();
        for shard in count.. {
            let name = queue_of(topology, shard).name;
            match bus.inspect_queue(&name).await? {
                None => break,
                Some(used) if used.is_idle() => surplus.push(name),
                Some(used) => {
                    return Err(BusError::DeclarationConflict {
                        reason: format!(
                            "{setting} is {count}, but the shard queue {name:?} above it is in use \
                             ({} messages waiting, {} consumers): every process of a deployment \
                             must use the same shard counts, and a count is lowered only once the \
                             shards above it are drained (stop the gateways, let the orchestrators \
                             empty the queues, then restart every process with the new count)",
                            used.messages, used.consumers
                        ),
                        name,
                    });
                }
            }
        }
        for name in surplus.iter().rev() {
            bus.retire_queue(name).await?;
            tracing::info!(queue = %name, setting, count, "retired a shard queue above the shard count");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: u32) -> NonZeroU32 {
        NonZeroU32::new(v).unwrap()
    }

    #[test]
    fn fnv1a_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn events_shard_is_stable_and_in_range() {
        let k = events_shard("default", Some("c1"), n(8));
        assert!(k < 8);
        assert_eq!(k, events_shard("default", Some("c1"), n(8)));
        assert_eq!(
            u64::from(k),
            fnv1a(b"default\0c1") % 8,
            "the shard is fnv1a(workspace NUL conversation) mod shards"
        );
        assert_eq!(
            events_shard("default", None, n(8)) as u64,
            fnv1a(b"default\0") % 8
        );
        assert_eq!(events_shard("w", Some("x"), n(1)), 0);
        assert_eq!(
            events_routing_key("default", Some("c1"), n(8)),
            format!("shard.{k}")
        );
    }

    #[test]
    fn an_event_is_announced_on_its_conversation_shard() {
        let topology = Topology::new(TopologyOptions {
            events_shards: n(8),
            ..TopologyOptions::default()
        })
        .unwrap();
        let workspace = WorkspaceId::new("ws-1").unwrap();
        let event_id = EventId::new();
        let announcement = topology.event_announcement(&workspace, event_id, Some("c1"));
        assert_eq!(announcement.exchange, topology.events_exchange());
        assert_eq!(
            announcement.routing_key,
            topology.events_routing_key("ws-1", Some("c1"))
        );
        let message: EventMessage = sb_protocol::messages::decode(&announcement.body).unwrap();
        assert_eq!(
            message,
            EventMessage::new(workspace.clone(), event_id).in_lane(event_lane(
                "ws-1",
                event_id,
                Some("c1")
            ))
        );
    }

    #[test]
    fn events_of_a_conversation_share_a_lane_and_others_have_their_own() {
        let (a, b) = (EventId::new(), EventId::new());
        assert_eq!(
            event_lane("ws", a, Some("c1")),
            event_lane("ws", b, Some("c1"))
        );
        assert_ne!(
            event_lane("ws", a, Some("c1")),
            event_lane("ws", a, Some("c2"))
        );
        assert_ne!(
            event_lane("ws", a, Some("c1")),
            event_lane("other", a, Some("c1"))
        );
        assert_ne!(event_lane("ws", a, None), event_lane("ws", b, None));
        assert_eq!(event_lane("ws", a, Some("")), event_lane("ws", a, None));
    }

    #[test]
    fn results_shard_hashes_the_run_id_text() {
        let run = RunId::new();
        assert_eq!(
            u64::from(results_shard(&run, n(5))),
            fnv1a(run.to_string().as_bytes()) % 5
        );
    }

    #[test]
    fn deliveries_keys_escape_topic_syntax() {
        let run = RunId::new();
        assert_eq!(
            deliveries_routing_key("ws.1", Some("a*b#c"), &run),
            format!("ws_1.a_b_c.{run}")
        );
        assert_eq!(
            deliveries_routing_key("ws", None, &run),
            format!("ws._.{run}")
        );
        assert_eq!(
            deliveries_routing_key("ws", Some(""), &run),
            format!("ws._.{run}")
        );
        let key = deliveries_routing_key("ws", Some("c"), &run);
        assert!(crate::bus::topic_matches(
            &deliveries_run_pattern(&run),
            &key
        ));
        assert!(crate::bus::topic_matches(
            &deliveries_conversation_pattern("ws", Some("c")),
            &key
        ));
        assert!(!crate::bus::topic_matches(
            &deliveries_conversation_pattern("ws", Some("d")),
            &key
        ));
        assert_eq!(control_routing_key(&run), format!("cancel.{run}"));
        assert!(crate::bus::topic_matches(
            CONTROL_ALL_PATTERN,
            &control_routing_key(&run)
        ));
    }

    #[test]
    fn deliveries_keys_stay_under_the_amqp_limit_whatever_the_ids() {
        let run = RunId::new();
        // 255 characters, multi-byte ones and topic syntax included (up to 1,020 bytes).
        for (workspace, conversation) in [
            ("ws".to_owned(), "c".repeat(255)),
            ("w".repeat(255), "é".repeat(255)),
            ("界.*#".repeat(64), "𝄞".repeat(255)),
        ] {
            let key = deliveries_routing_key(&workspace, Some(&conversation), &run);
            assert!(key.len() <= 255, "{} bytes: {key}", key.len());
            assert!(crate::bus::check_key(&key).is_ok());
            assert_eq!(key.split('.').count(), 3, "{key}");
            assert!(crate::bus::topic_matches(
                &deliveries_conversation_pattern(&workspace, Some(&conversation)),
                &key
            ));
            assert!(crate::bus::topic_matches(
                &deliveries_run_pattern(&run),
                &key
            ));
        }
        // Long ids sharing their first 96 bytes still get different words.
        let a = format!("{}a", "x".repeat(200));
        let b = format!("{}b", "x".repeat(200));
        assert_ne!(key_segment(&a), key_segment(&b));
        assert_eq!(key_segment(&a).len(), MAX_KEY_SEGMENT_BYTES);
        assert_eq!(key_segment(&a), key_segment(&a), "stable");
        // Ids within the bound keep their plain, escaped form.
        let plain = "c".repeat(MAX_KEY_SEGMENT_BYTES);
        assert_eq!(key_segment(&plain), plain);
    }

    #[test]
    fn names_carry_the_prefix() {
        let t = Topology::new(TopologyOptions {
            name_prefix: "test-1.switchboard".into(),
            events_shards: n(2),
            results_shards: n(3),
            pools: vec!["default".into(), "gpu".into()],
            ..TopologyOptions::default()
        })
        .unwrap();
        assert_eq!(t.events_exchange(), "test-1.switchboard.events");
        assert_eq!(
            Topology::new(TopologyOptions::default())
                .unwrap()
                .runs_queue("default")
                .name,
            "switchboard.runs.default"
        );
        assert_eq!(t.events_queue(1).name, "test-1.switchboard.events.1");
        assert!(t.events_queue(1).single_active_consumer);
        assert_eq!(
            t.events_queue(1).dead_letter_exchange.as_deref(),
            Some("test-1.switchboard.dead")
        );
        assert_eq!(t.runs_queue("gpu").bindings[0].routing_key, "gpu");
        assert_eq!(t.dead_queue().name, "test-1.switchboard.dead");
        assert_eq!(t.durable_queues().len(), 1 + 2 + 3 + 2);
        assert_eq!(
            t.deliveries_queue("gw.1").name,
            "test-1.switchboard.deliveries.gw_1"
        );
        assert_eq!(t.control_queue("w1").kind, crate::bus::QueueKind::Exclusive);
    }

    #[test]
    fn rejects_bad_pools() {
        for pools in [
            vec![],
            vec!["".to_string()],
            vec!["a.b".to_string()],
            vec!["a b".to_string()],
        ] {
            let options = TopologyOptions {
                pools,
                ..TopologyOptions::default()
            };
            assert!(matches!(
                Topology::new(options),
                Err(BusError::InvalidArgument(_))
            ));
        }
        for name_prefix in ["", ".sb", "sb.", "s*b", "s#b"] {
            let options = TopologyOptions {
                name_prefix: name_prefix.into(),
                ..TopologyOptions::default()
            };
            assert!(
                matches!(Topology::new(options), Err(BusError::InvalidArgument(_))),
                "{name_prefix}"
            );
        }
    }

    #[tokio::test]
    async fn declares_on_the_memory_bus() {
        let bus = crate::bus::memory::MemoryBus::new();
        let options = TopologyOptions {
            name_prefix: "t.switchboard".into(),
            ..TopologyOptions::default()
        };
        let t = declare_topology(&bus, &options).await.unwrap();
        // Idempotent.
        declare_topology(&bus, &options).await.unwrap();
        let run = RunId::new();
        bus.publish(
            &t.results_exchange(),
            &t.results_routing_key(&run),
            "x".into(),
            Default::default(),
        )
        .await
        .unwrap();
        let shard = results_shard(&run, options.results_shards);
        assert_eq!(bus.ready_count(&t.results_queue(shard).name), Some(1));
        t.delete(&bus).await.unwrap();
        assert_eq!(bus.ready_count(&t.results_queue(shard).name), None);
    }
}
