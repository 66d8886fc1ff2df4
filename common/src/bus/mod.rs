//! The message-bus boundary: publish with confirmation, subscribe with manual acknowledgement.
//!
//! Every role talks to the bus through [`Bus`] (usually as `Arc<dyn Bus>`), so the same code runs
//! on the in-process [`memory::MemoryBus`] (embedded mode, tests) and on RabbitMQ
//! ([`amqp::AmqpBus`], feature `amqp`). Both honour the contract written on [`Bus`]; the
//! conformance suite in `crate::testing::bus` (feature `test-util`) checks it against each
//! backend, so a behaviour a consumer relies on must be stated here and tested there.
//!
//! # Layout
//! - this file: the [`Bus`] trait and its contract, [`Subscription`], [`Delivery`], the
//!   declaration types ([`ExchangeSpec`], [`QueueSpec`], [`Binding`]) and [`BusError`].
//! - [`topology`]: every exchange, queue and routing-key name of SPEC §3, and
//!   [`topology::declare_topology`], used by every backend.
//! - [`memory`]: [`memory::MemoryBus`], tokio/mutex based, always compiled.
//! - `amqp`: `AmqpBus` on amqprs (feature `amqp`), with connection recovery.
//! - [`dead_letters`]: [`dead_letters::DeadLetters`], the operator's capability to peek at,
//!   replay and purge a dead-letter queue (`switchboard dlq`), implemented by both backends.
//!
//! # Message life cycle
//!
//! ```text
//!  publish ──▶ exchange ──(bindings)──▶ queue: ready ──▶ delivered (unacked) ──ack──▶ gone
//!     │            no match + mandatory        ▲               │   │
//!     ▼                                        │  nack(requeue) │   │ nack(no requeue) or
//!  Err(Unroutable)                             └─ subscription ─┘   │ delivery limit exceeded
//!                                                 dropped           ▼
//!                                                           dead-letter exchange
//!                                                                   │
//!                                      replay (DeadLetters) ◀── dead queue ──purge──▶ gone
//! ```

use std::fmt;
use std::num::NonZeroU16;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use tokio::sync::mpsc;

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod consumer;
pub mod dead_letters;
pub mod memory;
pub mod topology;

/// Result alias of the bus boundary.
pub type Result<T, E = BusError> = std::result::Result<T, E>;

/// A message bus with durable publishing and at-least-once, manually acknowledged consumption.
///
/// # Contract
///
/// **Declaration.** [`declare_exchange`](Bus::declare_exchange) and
/// [`declare_queue`](Bus::declare_queue) are idempotent: declaring the same name with the same
/// spec again succeeds and changes nothing; declaring an existing name with a different kind or
/// different arguments fails with [`BusError::DeclarationConflict`] and leaves the existing one
/// untouched. [`subscribe`](Bus::subscribe) declares its queue (and its bindings) first, so a
/// consumer never depends on someone else having declared it.
///
/// **Publishing.** [`publish`](Bus::publish) returns `Ok` only after the message is durable:
/// for RabbitMQ the broker has confirmed it (publisher confirms; persistent delivery mode), for
/// the memory bus it is stored in every matching queue. With [`PublishOptions::mandatory`] (the
/// default) a message that matches no binding is **not** silently dropped: the call fails with
/// [`BusError::Unroutable`]. An `Err` does not prove the message was *not* stored (a connection
/// can break after the broker stored it but before the confirm arrived): publishing is
/// at-least-once, consumers deduplicate. Publishing to an exchange that does not exist fails
/// with [`BusError::NotFound`]. [`publish_batch`](Bus::publish_batch) has the same guarantee per
/// message but pipelines the confirmations (everything is sent, then every confirm is awaited),
/// so a batch costs about one round trip instead of one per message.
///
/// **Best effort.** A message that is neither mandatory nor persistent
/// ([`PublishOptions::best_effort`], see [`PublishOptions::confirmed`]) is one its publisher
/// may lose (live deliveries, cancel broadcasts: the ledger and the session store hold the
/// truth), so it is not confirmed: `Ok` means it was handed to the broker connection (RabbitMQ:
/// written on a channel without publisher confirms), and it costs no round trip. It can be
/// lost with the connection, and one sent to an exchange that does not exist is dropped
/// (`Ok`, not [`BusError::NotFound`]); RabbitMQ then closes the channel, which the bus reopens
/// (best-effort messages sent in between are dropped as well). A malformed name or key is
/// still refused, and a call while the connection is down still waits for the next one.
///
/// **Ordering.** Messages published by one caller, one after the other (each `publish` awaited
/// before the next, or in one batch), reach a queue in that order, among confirmed messages
/// and among best-effort ones (RabbitMQ sends the two kinds on separate channels). A queue delivers in queue
/// order. Deliveries returned because their subscription was dropped go back to their original
/// position, ahead of younger messages, so a takeover continues in queue order. A message
/// nacked with `requeue = true` (or dropped unsettled) is delivered again but may come *after*
/// younger messages: RabbitMQ quorum queues append it, and the memory bus does the same so
/// code is tested against the stricter behaviour. A consumer that needs per-key order must not
/// requeue a message while later ones of the same key are processed.
///
/// **Consuming.** [`subscribe`](Bus::subscribe) returns a [`Subscription`] yielding
/// [`Delivery`]s. Each delivery must be settled exactly once with [`Delivery::ack`] (done,
/// removed) or [`Delivery::nack`] (`requeue = true`: back to the queue for another attempt;
/// `requeue = false`: dead-lettered if the queue has a dead-letter exchange, else dropped).
/// A delivery dropped without being settled is requeued. Further guarantees:
/// - at most [`ConsumeOptions::prefetch`] deliveries of one subscription are unacked at a
///   time (back-pressure: the bus stops delivering until some are settled);
/// - when a subscription is dropped (or its connection is lost), every delivery it had not
///   settled is returned to the queue and redelivered (to another subscription, or to this
///   one after it resubscribes) with [`Delivery::redelivered`] set;
/// - several subscriptions on one queue share its messages (round robin), except on a
///   [`QueueSpec::single_active_consumer`] queue, where exactly one subscription receives
///   messages at a time and the next one takes over, in queue order, when it is dropped; this
///   is what keeps per-shard order across several consumers;
/// - on a quorum queue with a [`QueueSpec::delivery_limit`] of `n`, a message that has been
///   returned to the queue more than `n` times is dead-lettered instead of delivered again
///   (so a poison message is attempted at most `n + 1` times).
///
/// **Routing.** [`ExchangeKind::Direct`]: the routing key equals the binding key.
/// [`ExchangeKind::Topic`]: dot-separated words, `*` in a binding matches exactly one word and
/// `#` zero or more words. [`ExchangeKind::Fanout`]: every bound queue, key ignored. A message
/// matching several bindings of one queue is stored in that queue once.
///
/// **Exclusive queues** ([`QueueKind::Exclusive`]) belong to this bus instance (its
/// connection) and are deleted when their last subscription is dropped (auto-delete) or the
/// connection closes; their bindings can be changed while they are consumed
/// ([`bind`](Bus::bind) / [`unbind`](Bus::unbind)), which is how a gateway follows the runs it
/// streams and a worker follows the runs it holds.
///
/// **Failures.** A lost connection is an [`BusError::Unavailable`] error for the calls in
/// flight (RabbitMQ: after retrying for a while; see the backend) while the backend reconnects
/// in the background; live subscriptions resume after reconnection without being recreated.
#[async_trait]
pub trait Bus: Send + Sync + 'static {
    /// Declares an exchange (idempotent; see the contract).
    async fn declare_exchange(&self, spec: &ExchangeSpec) -> Result<()>;

    /// Deletes an exchange and its bindings. Deleting a missing exchange succeeds.
    async fn delete_exchange(&self, name: &str) -> Result<()>;

    /// Declares a queue and adds its [`QueueSpec::bindings`] (idempotent; see the contract).
    /// Every exchange named in the bindings must exist ([`BusError::NotFound`] otherwise).
    async fn declare_queue(&self, spec: &QueueSpec) -> Result<()>;

    /// Deletes a queue with its messages and bindings. Deleting a missing queue succeeds.
    async fn delete_queue(&self, name: &str) -> Result<()>;

    /// What is in a queue, or `None` when no queue of that name exists.
    async fn inspect_queue(&self, name: &str) -> Result<Option<QueueUse>>;

    /// Deletes a queue only while it holds no message and has no consumer; a queue still in
    /// use is left as it is ([`BusError::DeclarationConflict`]), so nothing waiting in it is
    /// lost. Deleting a missing queue succeeds. This is how a queue the topology no longer
    /// names (a shard above a lowered shard count) is removed.
    ///
    /// RabbitMQ checks and deletes in two steps (its quorum queues have no conditional
    /// delete), so a message published in between is deleted with the queue: retire only
    /// queues nothing publishes to any more.
    async fn retire_queue(&self, name: &str) -> Result<()>;

    /// Adds a binding to an existing queue (idempotent). Used on live exclusive queues.
    async fn bind(&self, queue: &str, binding: &Binding) -> Result<()>;

    /// Removes a binding from a queue. Removing a binding that does not exist succeeds.
    async fn unbind(&self, queue: &str, binding: &Binding) -> Result<()>;

    /// Publishes one message and returns once it is durable (see the contract).
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
    ) -> Result<()>;

    /// Publishes several messages, pipelining their confirmations. `Ok` means every message is
    /// durable; otherwise the error lists the indices (into `messages`) that failed, and every
    /// index not listed is durable.
    async fn publish_batch(&self, messages: Vec<Outgoing>) -> Result<(), BatchPublishError>;

    /// Declares `queue` (with its bindings) and starts consuming from it.
    async fn subscribe(&self, queue: &QueueSpec, options: ConsumeOptions) -> Result<Subscription>;

    /// Returns `Ok` while the bus can reach its broker (readiness probes).
    async fn ping(&self) -> Result<()>;

    /// Closes the bus: live subscriptions end with [`BusError::Closed`] (their unsettled
    /// deliveries are requeued) and later calls fail with [`BusError::Closed`].
    async fn close(&self) -> Result<()>;
}

impl dyn Bus {
    /// Serializes `value` as JSON and [publishes](Bus::publish) it.
    pub async fn publish_json<T: serde::Serialize + ?Sized>(
        &self,
        exchange: &str,
        routing_key: &str,
        value: &T,
        options: PublishOptions,
    ) -> Result<()> {
        let body = serde_json::to_vec(value)
            .map_err(|e| BusError::InvalidArgument(format!("message cannot be serialized: {e}")))?;
        self.publish(exchange, routing_key, body.into(), options)
            .await
    }
}

/// What [`Bus::inspect_queue`] found in a queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueUse {
    /// Messages waiting in it (RabbitMQ counts the undelivered ones; a delivered one has its
    /// consumer, counted below).
    pub messages: u32,
    /// Subscribed consumers.
    pub consumers: u32,
}

impl QueueUse {
    /// Whether nothing waits in the queue and nobody consumes it.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.messages == 0 && self.consumers == 0
    }
}

/// [`Bus::retire_queue`]'s refusal of a queue in use.
pub(crate) fn in_use(name: &str, used: QueueUse) -> BusError {
    BusError::DeclarationConflict {
        name: name.to_owned(),
        reason: format!(
            "queue {name:?} is in use ({} messages waiting, {} consumers)",
            used.messages, used.consumers
        ),
    }
}

/// The exchange types of SPEC §3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    /// Routing key equals the binding key.
    Direct,
    /// Dot-separated words; `*` matches one word, `#` zero or more.
    Topic,
    /// Every bound queue.
    Fanout,
}

impl ExchangeKind {
    /// The AMQP name of the exchange type.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Topic => "topic",
            Self::Fanout => "fanout",
        }
    }
}

/// A durable exchange to declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangeSpec {
    /// Full name (prefix included).
    pub name: String,
    /// Routing behaviour.
    pub kind: ExchangeKind,
}

impl ExchangeSpec {
    /// A durable exchange of `kind` named `name`.
    pub fn new(name: impl Into<String>, kind: ExchangeKind) -> Self {
        Self {
            name: name.into(),
            kind,
        }
    }
}

/// A binding of a queue to an exchange.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Binding {
    /// Exchange name (prefix included).
    pub exchange: String,
    /// Exact key (direct), pattern (topic), or ignored (fanout; use `""`).
    pub routing_key: String,
}

impl Binding {
    /// A binding of `exchange` with `routing_key`.
    pub fn new(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }
    }
}

/// Lifetime of a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueKind {
    /// Durable, shared by every subscriber, survives broker restarts.
    #[default]
    Durable,
    /// Owned by this bus instance (its connection), deleted when its last subscription is
    /// dropped or the connection closes. Always a classic queue; messages are not persisted.
    Exclusive,
}

/// Storage type of a durable queue (RabbitMQ). Exclusive queues are always classic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Replicated Raft queue; supports delivery limits. The cluster default.
    #[default]
    Quorum,
    /// Classic queue; no delivery limit.
    Classic,
}

/// A queue to declare (and, with [`Bus::subscribe`], consume).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueSpec {
    /// Full name (prefix included).
    pub name: String,
    /// Bindings added on declaration.
    pub bindings: Vec<Binding>,
    /// Durable shared, or exclusive auto-delete.
    pub kind: QueueKind,
    /// Only one subscription receives messages at a time (order per queue).
    pub single_active_consumer: bool,
    /// Quorum or classic (ignored for exclusive queues).
    pub queue_type: QueueType,
    /// Dead-letter a message returned more than this many times (quorum queues only: RabbitMQ
    /// classic queues have no delivery limit, and the memory bus mirrors that).
    pub delivery_limit: Option<u32>,
    /// Exchange receiving nacked (`requeue = false`) and over-limit messages, with their
    /// original routing key. `None` drops them.
    pub dead_letter_exchange: Option<String>,
}

impl QueueSpec {
    /// A durable quorum queue with no bindings, no limit and no dead-letter exchange.
    pub fn durable(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            bindings: Vec::new(),
            kind: QueueKind::Durable,
            single_active_consumer: false,
            queue_type: QueueType::Quorum,
            delivery_limit: None,
            dead_letter_exchange: None,
        }
    }

    /// An exclusive auto-delete queue with no bindings.
    pub fn exclusive(name: impl Into<String>) -> Self {
        Self {
            kind: QueueKind::Exclusive,
            queue_type: QueueType::Classic,
            ..Self::durable(name)
        }
    }

    /// Adds a binding.
    #[must_use]
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push(Binding::new(exchange, routing_key));
        self
    }

    /// Sets the queue type.
    #[must_use]
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Makes the queue single-active-consumer.
    #[must_use]
    pub fn single_active_consumer(mut self) -> Self {
        self.single_active_consumer = true;
        self
    }

    /// Sets the delivery limit.
    #[must_use]
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Sets the dead-letter exchange.
    #[must_use]
    pub fn dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// The queue type actually used: exclusive queues are always classic.
    pub fn effective_queue_type(&self) -> QueueType {
        match self.kind {
            QueueKind::Exclusive => QueueType::Classic,
            QueueKind::Durable => self.queue_type,
        }
    }

    /// The delivery limit actually enforced (only quorum queues enforce one).
    pub fn effective_delivery_limit(&self) -> Option<u32> {
        match self.effective_queue_type() {
            QueueType::Quorum => self.delivery_limit,
            QueueType::Classic => None,
        }
    }
}

/// Per-message publishing options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishOptions {
    /// Fail with [`BusError::Unroutable`] when no binding matches. Default `true`. Set it to
    /// `false` only where "nobody listening" is normal (live deliveries, cancel broadcasts).
    pub mandatory: bool,
    /// Persist the message to disk (RabbitMQ delivery mode 2). Default `true`.
    pub persistent: bool,
}

impl Default for PublishOptions {
    fn default() -> Self {
        Self {
            mandatory: true,
            persistent: true,
        }
    }
}

impl PublishOptions {
    /// Options for best-effort fan-out: not mandatory, not persisted, not confirmed (live
    /// deliveries, cancel broadcasts: the ledger and the session store are the source of truth
    /// for those).
    pub fn best_effort() -> Self {
        Self {
            mandatory: false,
            persistent: false,
        }
    }

    /// Whether the publish waits for the broker's confirm: unless the message is neither
    /// mandatory nor persistent. Such a message is already one whose loss its publisher
    /// accepts (when nothing is bound, when the broker restarts); a confirm would only add
    /// "it reached the broker", at a round trip per publish (see "Best effort" on [`Bus`]).
    #[must_use]
    pub fn confirmed(self) -> bool {
        self.mandatory || self.persistent
    }
}

/// One message of a [`Bus::publish_batch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Body (JSON with a `schema` field by convention).
    pub body: Bytes,
    /// Options.
    pub options: PublishOptions,
}

impl Outgoing {
    /// A message with default (mandatory, persistent) options.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Bytes>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            options: PublishOptions::default(),
        }
    }
}

impl Outgoing {
    /// A message whose body is `value` as JSON, with default options.
    pub fn json<T: serde::Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let body = serde_json::to_vec(value)
            .map_err(|e| BusError::InvalidArgument(format!("message cannot be serialized: {e}")))?;
        Ok(Self::new(exchange, routing_key, body))
    }

    /// Replaces the options.
    #[must_use]
    pub fn with_options(mut self, options: PublishOptions) -> Self {
        self.options = options;
        self
    }
}

/// Subscription options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumeOptions {
    /// Maximum unacked deliveries in flight for this subscription.
    pub prefetch: NonZeroU16,
}

impl ConsumeOptions {
    /// Options with the given prefetch (0 is raised to 1).
    pub fn prefetch(prefetch: u16) -> Self {
        Self {
            prefetch: NonZeroU16::new(prefetch).unwrap_or(NonZeroU16::MIN),
        }
    }
}

impl Default for ConsumeOptions {
    /// Prefetch 32: enough to hide a round trip, small enough to spread work.
    fn default() -> Self {
        Self::prefetch(32)
    }
}

/// A live consumer of one queue. Dropping it cancels the consumer and returns every delivery
/// it had not settled to the queue.
pub struct Subscription {
    queue: String,
    receiver: mpsc::UnboundedReceiver<Result<Delivery>>,
    // Dropped after `receiver` (field order), so buffered deliveries are dropped first; each
    // backend makes settling idempotent so the order does not matter for correctness.
    _guard: Box<dyn Send + Sync>,
}

impl Subscription {
    /// Builds a subscription from a backend's delivery channel and its cancel guard (whose
    /// `Drop` cancels the consumer). For backends.
    pub fn new(
        queue: impl Into<String>,
        receiver: mpsc::UnboundedReceiver<Result<Delivery>>,
        guard: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            queue: queue.into(),
            receiver,
            _guard: guard,
        }
    }

    /// Name of the consumed queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Waits for the next delivery. Fails with [`BusError::Closed`] when the bus was closed or
    /// the queue deleted; transient connection losses are waited out (the consumer resumes).
    /// Cancel-safe.
    pub async fn next(&mut self) -> Result<Delivery> {
        match self.receiver.recv().await {
            Some(item) => item,
            None => Err(BusError::Closed),
        }
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// How a delivery is settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Processed: remove it.
    Ack,
    /// Not processed: back to the queue (`true`) or dead-letter (`false`).
    Nack {
        /// Return it to the queue.
        requeue: bool,
    },
}

/// Backend half of a delivery: settles it with the broker. For backends.
#[async_trait]
pub trait Settler: Send + Sync {
    /// Settles the delivery. May return once the settlement is handed on to be sent (the
    /// AMQP backend coalesces acks): a settlement lost after that is a lost connection, and
    /// the broker redelivers the message.
    async fn settle(&self, settlement: Settlement) -> Result<()>;
    /// Called when the delivery is dropped unsettled: must requeue it without blocking.
    fn requeue_on_drop(&self);
}

/// A message received from a [`Subscription`]. Settle it with [`ack`](Self::ack) or
/// [`nack`](Self::nack); dropping it unsettled requeues it.
pub struct Delivery {
    /// Message body.
    pub body: Bytes,
    /// Exchange it was published to.
    pub exchange: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// `true` if this message may have been delivered before (returned by a nack or by a
    /// dropped subscription).
    pub redelivered: bool,
    /// How many times this message was returned to the queue before this delivery: `0` on the
    /// first delivery. Exact on quorum queues and the memory bus; on RabbitMQ classic queues
    /// only the lower bound `redelivered as u32` is known.
    pub delivery_count: u32,
    settler: Option<Box<dyn Settler>>,
}

impl Delivery {
    /// Builds a delivery. For backends.
    pub fn new(
        body: Bytes,
        exchange: String,
        routing_key: String,
        redelivered: bool,
        delivery_count: u32,
        settler: Box<dyn Settler>,
    ) -> Self {
        Self {
            body,
            exchange,
            routing_key,
            redelivered,
            delivery_count,
            settler: Some(settler),
        }
    }

    /// Acknowledges: the message is removed from the queue. An error (connection lost, or
    /// the subscription already dropped) means the message was or will be redelivered.
    pub async fn ack(mut self) -> Result<()> {
        self.settle(Settlement::Ack).await
    }

    /// Rejects: `requeue = true` returns the message to the queue for another attempt (possibly
    /// behind younger messages; see the ordering contract on [`Bus`]); `false` dead-letters it (or drops it when the queue has no dead-letter
    /// exchange).
    pub async fn nack(mut self, requeue: bool) -> Result<()> {
        self.settle(Settlement::Nack { requeue }).await
    }

    /// Settles with an explicit [`Settlement`].
    pub async fn settle(&mut self, settlement: Settlement) -> Result<()> {
        match self.settler.take() {
            Some(settler) => settler.settle(settlement).await,
            None => Err(BusError::InvalidArgument("delivery already settled".into())),
        }
    }

    /// Parses the body as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body)
            .map_err(|e| BusError::InvalidArgument(format!("message body is not valid json: {e}")))
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(settler) = self.settler.take() {
            settler.requeue_on_drop();
        }
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("redelivered", &self.redelivered)
            .field("delivery_count", &self.delivery_count)
            .field("body_len", &self.body.len())
            .finish_non_exhaustive()
    }
}

/// Errors of the bus boundary.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// The broker cannot be reached (connection lost, reconnecting, or timed out).
    #[error("message bus unavailable: {0}")]
    Unavailable(String),
    /// A mandatory message matched no binding.
    #[error("message to exchange {exchange:?} with routing key {routing_key:?} is unroutable")]
    Unroutable {
        /// Target exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
    /// The broker refused to take responsibility for a message (publisher nack).
    #[error("broker rejected message to exchange {exchange:?} with routing key {routing_key:?}")]
    Rejected {
        /// Target exchange.
        exchange: String,
        /// Routing key.
        routing_key: String,
    },
    /// An exchange or queue does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// A declaration differs from the existing exchange or queue of that name.
    #[error("declaration of {name:?} conflicts with the existing one: {reason}")]
    DeclarationConflict {
        /// Exchange or queue name.
        name: String,
        /// What differs.
        reason: String,
    },
    /// A queue is exclusive to another connection.
    #[error("queue {0:?} is locked by another connection")]
    Locked(String),
    /// Bad input (names, already-settled delivery, undecodable body).
    #[error("invalid bus request: {0}")]
    InvalidArgument(String),
    /// The bus was closed, or the subscription's queue was deleted.
    #[error("message bus closed")]
    Closed,
    /// Any other broker error.
    #[error("message bus error: {0}")]
    Internal(String),
}

impl HasErrorCode for BusError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Unavailable(_) | Self::Closed => ErrorCode::Unavailable,
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::DeclarationConflict { .. } | Self::Locked(_) => ErrorCode::Conflict,
            Self::InvalidArgument(_) => ErrorCode::InvalidArgument,
            // An unroutable or rejected message is a topology problem on our side, not the
            // caller's: retrying later (after the consumer declared its queue) may succeed.
            Self::Unroutable { .. } | Self::Rejected { .. } => ErrorCode::Unavailable,
            Self::Internal(_) => ErrorCode::Internal,
        }
    }
}

/// Failure of some messages of a [`Bus::publish_batch`].
#[derive(Debug, thiserror::Error)]
#[error("{} of {total} messages of a batch failed; first: {}", failed.len(), first_error(failed))]
pub struct BatchPublishError {
    /// Number of messages in the batch.
    pub total: usize,
    /// Index (into the batch) and error of each failed message, in index order.
    pub failed: Vec<(usize, BusError)>,
}

fn first_error(failed: &[(usize, BusError)]) -> String {
    failed
        .first()
        .map(|(i, e)| format!("#{i}: {e}"))
        .unwrap_or_default()
}

impl BatchPublishError {
    /// `true` if message `index` of the batch failed.
    pub fn is_failed(&self, index: usize) -> bool {
        self.failed
            .binary_search_by_key(&index, |(i, _)| *i)
            .is_ok()
    }

    /// The same error for every message of a batch of `total` (connection-level failures).
    pub fn all(total: usize, error: impl Fn() -> BusError) -> Self {
        Self {
            total,
            failed: (0..total).map(|i| (i, error())).collect(),
        }
    }
}

impl HasErrorCode for BatchPublishError {
    fn code(&self) -> ErrorCode {
        self.failed
            .first()
            .map_or(ErrorCode::Internal, |(_, e)| e.code())
    }
}

/// Validates a routing key or binding key (AMQP short string, at most 255 bytes).
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.len() > 255 {
        return Err(BusError::InvalidArgument(format!(
            "routing key longer than 255 bytes: {key:.40}…"
        )));
    }
    Ok(())
}

/// Validates an exchange or queue name (AMQP short string, at most 255 bytes).
pub(crate) fn check_name(name: &str) -> Result<()> {
    if name.len() > 255 {
        return Err(BusError::InvalidArgument(format!(
            "name longer than 255 bytes: {name:.40}…"
        )));
    }
    Ok(())
}

/// `true` if a topic `pattern` (`*` = one word, `#` = zero or more words) matches `key`.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    // Without allocating: the memory bus matches every binding of a topic exchange on every
    // publish (a gateway's bindings are one per watched run or conversation).
    fn go<'a, P, K>(mut p: P, mut k: K) -> bool
    where
        P: Iterator<Item = &'a str> + Clone,
        K: Iterator<Item = &'a str> + Clone,
    {
        loop {
            match p.next() {
                None => return k.next().is_none(),
                Some("#") => loop {
                    if go(p.clone(), k.clone()) {
                        return true;
                    }
                    if k.next().is_none() {
                        return false;
                    }
                },
                Some("*") => {
                    if k.next().is_none() {
                        return false;
                    }
                }
                Some(word) => {
                    if k.next() != Some(word) {
                        return false;
                    }
                }
            }
        }
    }
    // An empty pattern or key has no words (not one empty word).
    fn words(s: &str) -> impl Iterator<Item = &str> + Clone {
        (!s.is_empty()).then(|| s.split('.')).into_iter().flatten()
    }
    go(words(pattern), words(key))
}

/// Default time a backend waits for the broker before failing a call with
/// [`BusError::Unavailable`].
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_wildcards() {
        assert!(topic_matches("a.b.c", "a.b.c"));
        assert!(!topic_matches("a.b.c", "a.b"));
        assert!(topic_matches("*.b.*", "a.b.c"));
        assert!(!topic_matches("*.b.*", "a.b.c.d"));
        assert!(!topic_matches("*", ""));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#", "a.b.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#", "a.b.c"));
        assert!(!topic_matches("a.#", "b.a"));
        assert!(topic_matches("#.c", "a.b.c"));
        assert!(topic_matches("a.#.c", "a.c"));
        assert!(topic_matches("a.#.c", "a.x.y.c"));
        assert!(!topic_matches("a.#.c", "a.x.y.d"));
        assert!(topic_matches("*.*.run1", "ws.conv.run1"));
        assert!(!topic_matches("*.*.run1", "ws.conv.run2"));
        assert!(topic_matches("", ""));
        assert!(!topic_matches("", "a"));
        assert!(topic_matches("#.#", "a"));
        assert!(topic_matches("a.*.#", "a.b"));
        assert!(!topic_matches("a.*.#", "a"));
        assert!(topic_matches("a.#.b.#", "a.x.b.y.b"));
        assert!(!topic_matches("a.#.b", "a.b.c"));
    }

    #[test]
    fn batch_error_index_lookup() {
        let e = BatchPublishError {
            total: 4,
            failed: vec![
                (1, BusError::Closed),
                (3, BusError::Unavailable("x".into())),
            ],
        };
        assert!(e.is_failed(1) && e.is_failed(3));
        assert!(!e.is_failed(0) && !e.is_failed(2));
        assert_eq!(e.code(), ErrorCode::Unavailable);
    }
}
