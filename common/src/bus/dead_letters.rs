//! Dead letters: looking at, replaying and purging what a dead-letter queue holds (SPEC §3,
//! `switchboard dlq`).
//!
//! A work queue declared with a [`dead_letter_exchange`](super::QueueSpec::dead_letter_exchange)
//! sends a message there when a consumer nacks it without requeue ([`DeathReason::Rejected`])
//! or when it was returned more than the queue's delivery limit
//! ([`DeathReason::DeliveryLimit`]); the topology binds `<prefix>.dead` to that exchange. The
//! backend records where the message died (RabbitMQ: the `x-death` header), so it can be sent
//! back there once the cause is fixed.
//!
//! [`DeadLetters`] is a capability of a backend, apart from [`Bus`](super::Bus): every role
//! needs the bus, only the operator command needs this. Both backends implement it, and the
//! conformance suite in `crate::testing::dead_letters` checks both against the contract below.

use async_trait::async_trait;
use bytes::Bytes;

use super::{BusError, QueueSpec, Result};

/// Inspecting, replaying and purging a dead-letter queue.
///
/// Every operation takes the [`QueueSpec`] of the dead queue (the topology's
/// [`dead_queue`](super::topology::Topology::dead_queue)), whose type decides how RabbitMQ takes
/// messages back (below).
///
/// # Contract
///
/// Only the *ready* messages of the queue are concerned: a message some consumer of the dead
/// queue holds unacknowledged is invisible to every operation (nothing in Switchboard consumes
/// the dead queue; operators go through this trait). A queue that does not exist is
/// [`BusError::NotFound`].
///
/// **Peek** ([`peek`](DeadLetters::peek)) returns at most `limit` messages from the head, in
/// queue order, with the number of ready messages, and leaves every message in the queue, in
/// the same order: none is removed, duplicated or dead-lettered, so peeking twice gives the
/// same result. RabbitMQ has no read-without-taking, so the AMQP backend takes the messages
/// unacknowledged on a channel of its own and gives them back with one
/// `basic.nack(multiple, requeue)`, then waits until the queue counts them as ready again:
/// - a classic queue puts them back at their original positions: only the shown head is
///   taken;
/// - a quorum queue puts them at its back (RabbitMQ 3.10+, queues without a delivery limit like
///   the dead queue) or serves them first (queues with one): either way the order is kept only
///   if *every* message is taken and given back, so a peek reads the whole quorum queue
///   (`limit` 0 only counts, taking nothing); a message dead-lettered while that runs may end
///   up ahead of the ones given back;
/// - a quorum queue counts each return as a delivery of the message. RabbitMQ 3.x and 4.3+ put
///   no limit on that for the dead queue (it is declared without a delivery limit, and 4.3+
///   does not count `basic.nack`), but RabbitMQ 4.0–4.2 apply a default limit of 20 and drop
///   the message past it: there, give the dead queue a higher delivery limit with a policy
///   before peeking it repeatedly.
///
/// **Replay** ([`replay`](DeadLetters::replay)) walks the queue from the head and sends each
/// selected message back to the exchange and routing key it died from ([`Death::exchange`],
/// [`Death::routing_key`]), so it is routed by *today's* bindings (a pool or shard that no
/// longer exists makes it unroutable; it then stays dead). For each message, in this order:
/// 1. it is taken from the dead queue *unacknowledged*, so it cannot be lost: if anything
///    below fails, or the process dies, the broker gives it back to the dead queue;
/// 2. it is published with publisher confirms, `mandatory`, persistent, without the broker's
///    `x-` headers (`x-death`, `x-delivery-count`, …): the replay is a first delivery for its
///    consumer, whose retry backoff starts from zero again;
/// 3. only after the broker confirmed the publish is the dead copy acknowledged (removed).
///
/// A failure between 2 and 3 (connection lost) leaves both the replayed message and its dead
/// copy: replay is **at-least-once**, which is safe because every consumer is idempotent by
/// design (SPEC §11: event id, run id, (run id, sequence)) — never at-most-once, which could
/// lose the message. Messages that are not replayed (not selected by [`ReplayOptions::id`],
/// past [`ReplayOptions::limit`], without a known origin, or refused by the broker) stay in
/// the dead queue, in order (taken and given back as a peek does).
///
/// One replay examines at most the number of messages the queue held when it started, so a
/// replayed message that dies again at once (its cause is not fixed) is not replayed a second
/// time by the same call.
///
/// **Purge** ([`purge`](DeadLetters::purge)) deletes every ready message and returns how many.
#[async_trait]
pub trait DeadLetters: Send + Sync + 'static {
    /// Up to `limit` messages from the head of `queue`, left in place (see the contract).
    async fn peek(&self, queue: &QueueSpec, limit: usize) -> Result<DeadLetterList>;

    /// Sends the selected messages of `queue` back where they died (see the contract). `Err`
    /// only when nothing was done (queue missing, broker unreachable); a failure after the
    /// start is reported in [`ReplayReport::interrupted`] with what was done until then.
    async fn replay(&self, queue: &QueueSpec, options: &ReplayOptions) -> Result<ReplayReport>;

    /// Deletes every ready message of `queue`; returns how many were deleted.
    async fn purge(&self, queue: &QueueSpec) -> Result<u64>;
}

/// The head of a dead-letter queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterList {
    /// Ready messages in the queue when it was read.
    pub total: usize,
    /// The first of them, in queue order.
    pub letters: Vec<DeadLetter>,
}

/// One message of a dead-letter queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Position in the queue when it was read, from 1 (the head).
    pub position: usize,
    /// What `replay --id` selects it by: [`message_id`](Self::message_id) when the publisher
    /// set one, else [`content_id`] of the body (Switchboard's publishers set none; the body
    /// carries the event or run id). Identical bodies share an id, which is harmless: they are
    /// copies of one message.
    pub id: String,
    /// The AMQP `message-id` property, if the publisher set one.
    pub message_id: Option<String>,
    /// The AMQP `type` property, if the publisher set one (see also [`schema`](Self::schema)).
    pub message_type: Option<String>,
    /// Where and why it died; `None` for a message published to the dead-letter exchange
    /// directly, which has no origin to be replayed to.
    pub death: Option<Death>,
    /// The body, unchanged.
    pub body: Bytes,
}

impl DeadLetter {
    /// The `schema` field of a JSON object body (`switchboard.job/1`, …), which names the
    /// message type of every Switchboard message (SPEC §3).
    pub fn schema(&self) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct Schema {
            schema: String,
        }
        serde_json::from_slice::<Schema>(&self.body)
            .ok()
            .map(|s| s.schema)
    }
}

/// The most recent death of a dead letter (RabbitMQ: the first entry of `x-death`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Death {
    /// The exchange the message had been published to (where a replay sends it).
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// The queue it died in.
    pub queue: String,
    /// Why it died.
    pub reason: DeathReason,
    /// How many times it died in that queue for that reason (a replay starts a new history).
    pub count: u32,
}

/// Why a message was dead-lettered, as RabbitMQ names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeathReason {
    /// A consumer nacked it without requeue (`rejected`).
    Rejected,
    /// It was returned more times than the queue's delivery limit (`delivery_limit`).
    DeliveryLimit,
    /// Its TTL ran out (`expired`).
    Expired,
    /// The queue was over its length limit (`maxlen`).
    MaxLength,
    /// A reason this version does not know.
    Other(String),
}

impl DeathReason {
    /// RabbitMQ's name of the reason.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Rejected => "rejected",
            Self::DeliveryLimit => "delivery_limit",
            Self::Expired => "expired",
            Self::MaxLength => "maxlen",
            Self::Other(reason) => reason,
        }
    }

    /// The reason named `name` by RabbitMQ.
    pub fn parse(name: &str) -> Self {
        match name {
            "rejected" => Self::Rejected,
            "delivery_limit" => Self::DeliveryLimit,
            "expired" => Self::Expired,
            "maxlen" => Self::MaxLength,
            other => Self::Other(other.to_owned()),
        }
    }
}

impl std::fmt::Display for DeathReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The id of a body without a `message-id`: 64-bit FNV-1a of the bytes, 16 hex digits. Stable
/// across processes and versions, so an id printed by `dlq list` selects the same message in a
/// later `dlq replay --id`.
pub fn content_id(body: &[u8]) -> String {
    format!("{:016x}", super::topology::fnv1a(body))
}

/// Which messages a [`DeadLetters::replay`] sends back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Replay at most this many (from the head); `None`: every one.
    pub limit: Option<usize>,
    /// Replay only the messages with this [`DeadLetter::id`].
    pub id: Option<String>,
}

impl ReplayOptions {
    fn selects(&self, letter_id: &str) -> bool {
        self.id.as_deref().is_none_or(|id| id == letter_id)
    }
}

/// What a [`DeadLetters::replay`] did.
#[derive(Debug, Default)]
pub struct ReplayReport {
    /// Messages taken from the queue and looked at (selected or not).
    pub examined: usize,
    /// Messages republished, confirmed and removed from the dead queue.
    pub replayed: usize,
    /// Selected messages left in the dead queue because they have no recorded origin.
    pub without_origin: Vec<DeadLetter>,
    /// Selected messages left in the dead queue because the broker refused to take them back
    /// (the exchange is gone, no queue is bound for the key anymore, …).
    pub failed: Vec<(DeadLetter, BusError)>,
    /// Why the replay stopped early (connection lost, bus closed). Messages not yet removed
    /// are back in the dead queue; one replayed just before may be there too (at-least-once).
    pub interrupted: Option<BusError>,
}

impl ReplayReport {
    /// Selected messages that were not replayed: without origin, or refused.
    pub fn left_in_place(&self) -> usize {
        self.without_origin.len() + self.failed.len()
    }

    /// `true` when every selected message was replayed and nothing stopped the replay.
    pub fn is_complete(&self) -> bool {
        self.left_in_place() == 0 && self.interrupted.is_none()
    }
}

/// The shared walk of a replay over messages taken from a dead queue one at a time, so both
/// backends decide alike. For each message the backend calls [`next`](Self::next) to know what
/// to do, then reports the outcome.
pub(crate) struct ReplayWalk<'a> {
    options: &'a ReplayOptions,
    /// Messages in the queue at the start: the walk never examines more (see the contract).
    bound: usize,
    pub(crate) report: ReplayReport,
}

/// What to do with one examined message.
pub(crate) enum Step {
    /// Leave it in the dead queue.
    Keep,
    /// Publish it to this exchange and routing key, then remove it from the dead queue.
    Replay {
        exchange: String,
        routing_key: String,
    },
}

impl<'a> ReplayWalk<'a> {
    pub(crate) fn new(options: &'a ReplayOptions, bound: usize) -> Self {
        Self {
            options,
            bound,
            report: ReplayReport::default(),
        }
    }

    /// `false` once the limit is reached or every message present at the start was examined.
    pub(crate) fn wants_more(&self) -> bool {
        self.report.examined < self.bound
            && self
                .options
                .limit
                .is_none_or(|limit| self.report.replayed < limit)
    }

    /// Counts `letter` as examined and decides its fate.
    pub(crate) fn next(&mut self, letter: &DeadLetter) -> Step {
        self.report.examined += 1;
        if !self.options.selects(&letter.id) {
            return Step::Keep;
        }
        match &letter.death {
            Some(death) => Step::Replay {
                exchange: death.exchange.clone(),
                routing_key: death.routing_key.clone(),
            },
            None => {
                self.report.without_origin.push(letter.clone());
                Step::Keep
            }
        }
    }

    /// The publish of `letter` was refused for good: it stays dead.
    pub(crate) fn refused(&mut self, letter: DeadLetter, error: BusError) {
        self.report.failed.push((letter, error));
    }

    /// `letter` was replayed and its dead copy removed.
    pub(crate) fn replayed(&mut self) {
        self.report.replayed += 1;
    }
}

/// `true` for a publish error that concerns only the message (it stays dead, the replay goes
/// on); `false` for one that concerns the connection or the bus (the replay stops).
pub(crate) fn refusal_is_per_message(error: &BusError) -> bool {
    matches!(
        error,
        BusError::Unroutable { .. }
            | BusError::Rejected { .. }
            | BusError::NotFound(_)
            | BusError::InvalidArgument(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(id: &str, death: Option<Death>) -> DeadLetter {
        DeadLetter {
            position: 1,
            id: id.into(),
            message_id: None,
            message_type: None,
            death,
            body: Bytes::from_static(b"{}"),
        }
    }

    fn death() -> Death {
        Death {
            exchange: "ex".into(),
            routing_key: "k".into(),
            queue: "q".into(),
            reason: DeathReason::Rejected,
            count: 1,
        }
    }

    #[test]
    fn reasons_round_trip_rabbitmq_names() {
        for name in [
            "rejected",
            "delivery_limit",
            "expired",
            "maxlen",
            "something_new",
        ] {
            assert_eq!(DeathReason::parse(name).as_str(), name);
        }
        assert_eq!(DeathReason::parse("maxlen"), DeathReason::MaxLength);
        assert_eq!(DeathReason::DeliveryLimit.to_string(), "delivery_limit");
    }

    #[test]
    fn content_id_is_stable_and_distinguishes_bodies() {
        assert_eq!(content_id(b""), "cbf29ce484222325", "FNV-1a offset basis");
        assert_eq!(content_id(b"a"), content_id(b"a"));
        assert_ne!(content_id(b"a"), content_id(b"b"));
        assert_eq!(content_id(b"a").len(), 16);
    }

    #[test]
    fn schema_comes_from_a_json_object_body() {
        let mut l = letter("x", None);
        l.body = Bytes::from_static(br#"{"schema":"switchboard.job/1","run_id":"r"}"#);
        assert_eq!(l.schema().as_deref(), Some("switchboard.job/1"));
        l.body = Bytes::from_static(b"not json");
        assert_eq!(l.schema(), None);
        l.body = Bytes::from_static(br#"{"schema":7}"#);
        assert_eq!(l.schema(), None);
    }

    #[test]
    fn walk_stops_at_the_limit_and_at_the_bound() {
        let options = ReplayOptions {
            limit: Some(1),
            id: None,
        };
        let mut walk = ReplayWalk::new(&options, 5);
        assert!(walk.wants_more());
        assert!(matches!(
            walk.next(&letter("a", Some(death()))),
            Step::Replay { .. }
        ));
        walk.replayed();
        assert!(!walk.wants_more(), "limit reached");

        let all = ReplayOptions::default();
        let mut walk = ReplayWalk::new(&all, 2);
        for _ in 0..2 {
            assert!(walk.wants_more());
            walk.next(&letter("a", Some(death())));
            walk.replayed();
        }
        assert!(
            !walk.wants_more(),
            "never more than the queue held at the start"
        );
    }

    #[test]
    fn walk_keeps_unselected_and_originless_messages() {
        let options = ReplayOptions {
            limit: None,
            id: Some("b".into()),
        };
        let mut walk = ReplayWalk::new(&options, 10);
        assert!(matches!(walk.next(&letter("a", Some(death()))), Step::Keep));
        assert!(
            walk.report.without_origin.is_empty(),
            "not selected is not reported"
        );
        assert!(matches!(walk.next(&letter("b", None)), Step::Keep));
        assert_eq!(walk.report.without_origin.len(), 1);
        match walk.next(&letter("b", Some(death()))) {
            Step::Replay {
                exchange,
                routing_key,
            } => assert_eq!((exchange.as_str(), routing_key.as_str()), ("ex", "k")),
            Step::Keep => panic!("a selected message with an origin is replayed"),
        }
        assert_eq!(walk.report.examined, 3);
        assert!(!walk.report.is_complete());
    }

    #[test]
    fn per_message_refusals_are_told_apart_from_outages() {
        assert!(refusal_is_per_message(&BusError::Unroutable {
            exchange: "e".into(),
            routing_key: "k".into()
        }));
        assert!(refusal_is_per_message(&BusError::NotFound(
            "exchange".into()
        )));
        assert!(!refusal_is_per_message(&BusError::Unavailable(
            "down".into()
        )));
        assert!(!refusal_is_per_message(&BusError::Closed));
    }
}
