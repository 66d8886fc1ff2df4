//! RabbitMQ [`Bus`] on lapin (feature `amqp`).
//!
//! # Shape
//! One AMQP connection per [`AmqpBus`] (a "link"), with:
//! - a **publish channel** in confirm mode: every publish is persistent (delivery mode 2) unless
//!   asked otherwise, `mandatory` by default, and awaited until the broker's ack; a batch
//!   sends every message and then awaits every confirm (one round trip for the batch);
//! - a **best-effort channel** without confirm mode for the messages that are neither
//!   mandatory nor persistent (live deliveries, cancel broadcasts; see "Best effort" on
//!   [`Bus`]): a publish there returns once written, and the broker sends nothing back. A
//!   broker error on it (RabbitMQ closes the channel on a `404` for a missing exchange)
//!   surfaces on a later publish, which reopens the channel and sends again;
//! - a **topology channel** for declarations, (un)bindings and deletions, used one operation
//!   at a time so a channel error (RabbitMQ closes a channel on `404`/`406`) is attributed to
//!   the operation that caused it; the channel is reopened after such an error;
//! - one **channel per subscription**, so `basic.qos` (prefetch) is per subscription and
//!   dropping a subscription (closing its channel) returns exactly its unacked messages.
//!
//! Durable queues are quorum queues by default (`x-queue-type`, `x-delivery-limit`,
//! `x-dead-letter-exchange`, `x-single-active-consumer`); exclusive queues are classic,
//! exclusive and auto-delete.
//!
//! # Recovery
//! A supervisor task watches the link (lapin's error callback, failed operations, and a
//! periodic liveness check). When the connection is lost it reconnects with exponential
//! backoff (`backoff` crate, [`AmqpOptions::reconnect_min`] to [`AmqpOptions::reconnect_max`]),
//! re-declares every exchange, queue and binding declared through this bus (including
//! exclusive queues, which died with the old connection, with their current bindings), and
//! only then publishes the new link. Meanwhile:
//! - calls wait for the new link and retry (declarations are idempotent; an unconfirmed
//!   publish is published again, so a message may be duplicated — never lost) until
//!   [`AmqpOptions::operation_timeout`], then fail with [`BusError::Unavailable`];
//! - each live subscription re-opens its channel and consumer on the new link; the
//!   deliveries it had not settled were requeued by the broker, and settling them fails with
//!   [`BusError::Unavailable`] (they come again, with `redelivered` set).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use backoff::backoff::Backoff as _;
use bytes::Bytes;
use futures::StreamExt;
use lapin::acker::Acker;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ErrorKind};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::dead_letters::{
    DeadLetter, DeadLetterList, DeadLetters, Death, DeathReason, ReplayOptions, ReplayReport,
    ReplayWalk, Step, content_id, refusal_is_per_message,
};
use super::{
    BatchPublishError, Binding, Bus, BusError, ConsumeOptions, Delivery, ExchangeKind,
    ExchangeSpec, Outgoing, PublishOptions, QueueKind, QueueSpec, QueueType, Result, Settlement,
    Settler, Subscription, check_key, check_name,
};

/// Connection options of [`AmqpBus`]; the config layer maps its bus section onto this.
#[derive(Clone)]
pub struct AmqpOptions {
    /// `amqp://user:password@host:port/vhost` (`%2f` is the default vhost).
    pub url: String,
    /// Shown by the broker (`rabbitmqctl list_connections client_properties`); include the
    /// role and host so an operator can tell connections apart.
    pub connection_name: String,
    /// How long a call waits for the broker (including reconnection) before failing with
    /// [`BusError::Unavailable`].
    pub operation_timeout: Duration,
    /// First reconnection delay.
    pub reconnect_min: Duration,
    /// Largest reconnection delay.
    pub reconnect_max: Duration,
}

impl AmqpOptions {
    /// Options for `url` with defaults: 30 s operation timeout, reconnect every 100 ms
    /// doubling up to 5 s.
    pub fn new(url: impl Into<String>, connection_name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            connection_name: connection_name.into(),
            operation_timeout: super::DEFAULT_OPERATION_TIMEOUT,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

impl std::fmt::Debug for AmqpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password.
        let url = match url::Url::parse(&self.url) {
            Ok(mut url) if url.password().is_some() => {
                let _ = url.set_password(Some("***"));
                url.to_string()
            }
            Ok(url) => url.to_string(),
            Err(_) => "<unparsable url>".into(),
        };
        f.debug_struct("AmqpOptions")
            .field("url", &url)
            .field("connection_name", &self.connection_name)
            .field("operation_timeout", &self.operation_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .finish()
    }
}

/// How often the supervisor checks that the connection is still up, in addition to lapin's
/// error callback (a client-side close, for instance, does not trigger the callback).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);
/// Pause between two attempts of an operation that failed on a closed channel.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// The RabbitMQ bus. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct AmqpBus {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AmqpBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpBus")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

struct Inner {
    options: AmqpOptions,
    /// The current link; subscriptions and calls wait on changes.
    state: watch::Sender<LinkState>,
    /// Everything declared through this bus, re-declared after a reconnection.
    registry: Mutex<Registry>,
    /// Wakes the supervisor when a link looks broken.
    broken: Arc<Notify>,
    /// Cancelled by [`Bus::close`] or when the last handle is dropped.
    shutdown: CancellationToken,
    next_consumer: AtomicU64,
}

#[derive(Clone)]
enum LinkState {
    /// Connected.
    Up(Arc<Link>),
    /// Reconnecting; the number is the generation of the link that was lost.
    Down(u64),
    /// [`Bus::close`] was called.
    Closed,
}

struct Link {
    generation: u64,
    connection: Connection,
    publish: tokio::sync::Mutex<Channel>,
    /// Without confirm mode: for unconfirmed messages ([`PublishOptions::confirmed`]).
    best_effort: tokio::sync::Mutex<Channel>,
    topology: tokio::sync::Mutex<Channel>,
}

#[derive(Default)]
struct Registry {
    exchanges: BTreeMap<String, ExchangeSpec>,
    /// Queue specs with their *current* bindings, and the number of live subscriptions.
    queues: BTreeMap<String, (QueueSpec, usize)>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let LinkState::Up(link) = &*self.state.borrow() {
            let link = link.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = link.connection.close(200, "bus dropped").await;
                });
            }
        }
    }
}

/// What to do with a failed broker call.
enum Failure {
    /// The connection is gone: wait for the next link and retry.
    Connection,
    /// The channel was closed (by an error of another operation, or while closing): retry on
    /// a fresh channel.
    Channel,
    /// A definitive answer from the broker.
    Final(BusError),
}

fn classify(error: &lapin::Error) -> Failure {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => {
                let text = amqp.get_message().as_str().to_owned();
                Failure::Final(match soft {
                    AMQPSoftError::NOTFOUND => BusError::NotFound(text),
                    AMQPSoftError::PRECONDITIONFAILED => BusError::DeclarationConflict {
                        name: extract_name(&text),
                        reason: text,
                    },
                    AMQPSoftError::RESOURCELOCKED => BusError::Locked(extract_name(&text)),
                    AMQPSoftError::ACCESSREFUSED => BusError::InvalidArgument(text),
                    _ => BusError::Internal(text),
                })
            }
            AMQPErrorKind::Hard(_) => Failure::Connection,
        },
        ErrorKind::IOError(_)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::MissingHeartbeatError => Failure::Connection,
        ErrorKind::InvalidChannel(_) | ErrorKind::InvalidChannelState(..) => Failure::Channel,
        _ => Failure::Final(BusError::Internal(error.to_string())),
    }
}

/// Pulls the object name out of a RabbitMQ reply text (`… for queue 'x' in vhost '/'`).
fn extract_name(text: &str) -> String {
    for marker in ["queue '", "exchange '"] {
        if let Some(start) = text.find(marker) {
            let rest = &text[start + marker.len()..];
            if let Some(end) = rest.find('\'') {
                return rest[..end].to_owned();
            }
        }
    }
    text.split('\'').nth(1).unwrap_or(text).to_owned()
}

fn exchange_kind(kind: ExchangeKind) -> lapin::ExchangeKind {
    match kind {
        ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        ExchangeKind::Topic => lapin::ExchangeKind::Topic,
        ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
    }
}

/// Declare options and arguments of a queue spec.
fn queue_arguments(spec: &QueueSpec) -> (QueueDeclareOptions, FieldTable) {
    let mut args = FieldTable::default();
    let options = match spec.kind {
        QueueKind::Durable => QueueDeclareOptions {
            durable: true,
            exclusive: false,
            auto_delete: false,
            ..Default::default()
        },
        QueueKind::Exclusive => QueueDeclareOptions {
            durable: false,
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        },
    };
    if spec.effective_queue_type() == QueueType::Quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    if let Some(limit) = spec.effective_delivery_limit() {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(limit)),
        );
    }
    if let Some(dlx) = &spec.dead_letter_exchange {
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(dlx.as_str().into()),
        );
    }
    if spec.single_active_consumer {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    (options, args)
}

fn header_count(value: &AMQPValue) -> Option<u32> {
    let n: i64 = match value {
        AMQPValue::ShortShortInt(v) => (*v).into(),
        AMQPValue::ShortShortUInt(v) => (*v).into(),
        AMQPValue::ShortInt(v) => (*v).into(),
        AMQPValue::ShortUInt(v) => (*v).into(),
        AMQPValue::LongInt(v) => (*v).into(),
        AMQPValue::LongUInt(v) => (*v).into(),
        AMQPValue::LongLongInt(v) => *v,
        _ => return None,
    };
    u32::try_from(n).ok()
}

impl Link {
    async fn open(
        options: &AmqpOptions,
        generation: u64,
    ) -> std::result::Result<Self, lapin::Error> {
        let properties = ConnectionProperties::default()
            .with_connection_name(options.connection_name.as_str().into())
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let connection = Connection::connect(&options.url, properties).await?;
        let publish = Self::publish_channel(&connection).await?;
        let best_effort = connection.create_channel().await?;
        let topology = connection.create_channel().await?;
        Ok(Self {
            generation,
            connection,
            publish: tokio::sync::Mutex::new(publish),
            best_effort: tokio::sync::Mutex::new(best_effort),
            topology: tokio::sync::Mutex::new(topology),
        })
    }

    async fn publish_channel(
        connection: &Connection,
    ) -> std::result::Result<Channel, lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// The publish channel, reopened if a channel error closed it.
    async fn publisher(&self) -> std::result::Result<Channel, lapin::Error> {
        let mut channel = self.publish.lock().await;
        if !channel.status().connected() {
            *channel = Self::publish_channel(&self.connection).await?;
        }
        Ok(channel.clone())
    }

    /// The best-effort channel, reopened if a channel error closed it.
    async fn best_effort_publisher(&self) -> std::result::Result<Channel, lapin::Error> {
        let mut channel = self.best_effort.lock().await;
        if !channel.status().connected() {
            *channel = self.connection.create_channel().await?;
        }
        Ok(channel.clone())
    }

    /// The channel for messages published with `options`.
    async fn publisher_for(
        &self,
        options: PublishOptions,
    ) -> std::result::Result<Channel, lapin::Error> {
        if options.confirmed() {
            self.publisher().await
        } else {
            self.best_effort_publisher().await
        }
    }

    /// Runs one operation on the topology channel (serialized; the channel is reopened first
    /// if an earlier error closed it).
    async fn topology_op<T, F, Fut>(&self, op: F) -> std::result::Result<T, lapin::Error>
    where
        F: FnOnce(Channel) -> Fut,
        Fut: Future<Output = std::result::Result<T, lapin::Error>>,
    {
        let mut channel = self.topology.lock().await;
        if !channel.status().connected() {
            *channel = self.connection.create_channel().await?;
        }
        op(channel.clone()).await
    }

    async fn declare_exchange(&self, spec: &ExchangeSpec) -> std::result::Result<(), lapin::Error> {
        self.topology_op(|ch| async move {
            ch.exchange_declare(
                spec.name.as_str(),
                exchange_kind(spec.kind),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
        })
        .await
    }

    async fn declare_queue(&self, spec: &QueueSpec) -> std::result::Result<(), lapin::Error> {
        let (options, args) = queue_arguments(spec);
        self.topology_op(|ch| async move {
            ch.queue_declare(spec.name.as_str(), options, args)
                .await
                .map(drop)
        })
        .await
    }

    async fn bind(&self, queue: &str, binding: &Binding) -> std::result::Result<(), lapin::Error> {
        self.topology_op(|ch| async move {
            ch.queue_bind(
                queue,
                binding.exchange.as_str(),
                binding.routing_key.as_str(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        })
        .await
    }

    /// Re-declares everything in the registry on a fresh link. Channel-level refusals (someone
    /// changed or deleted a declared object meanwhile) are logged and skipped; a connection
    /// failure aborts (the supervisor retries with a new connection).
    async fn redeclare(
        &self,
        registry: (Vec<ExchangeSpec>, Vec<QueueSpec>),
    ) -> std::result::Result<(), lapin::Error> {
        let (exchanges, queues) = registry;
        let skip = |what: &str, name: &str, e: lapin::Error| match classify(&e) {
            Failure::Connection => Err(e),
            _ => {
                tracing::warn!(error = %e, what, name, "could not re-declare after reconnecting");
                Ok(())
            }
        };
        for exchange in &exchanges {
            if let Err(e) = self.declare_exchange(exchange).await {
                skip("exchange", &exchange.name, e)?;
            }
        }
        for queue in &queues {
            if let Err(e) = self.declare_queue(queue).await {
                skip("queue", &queue.name, e)?;
                continue;
            }
            for binding in &queue.bindings {
                if let Err(e) = self.bind(&queue.name, binding).await {
                    skip("binding", &queue.name, e)?;
                }
            }
        }
        Ok(())
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        matches!(*self.state.borrow(), LinkState::Closed)
    }

    /// Marks link `generation` as broken (once) and wakes the supervisor.
    fn report_broken(&self, generation: u64) {
        let mut lost = None;
        self.state.send_if_modified(|state| match state {
            LinkState::Up(link) if link.generation == generation => {
                lost = Some(link.clone());
                *state = LinkState::Down(generation);
                true
            }
            _ => false,
        });
        if let Some(link) = lost {
            tracing::warn!(generation, "lost the broker connection; reconnecting");
            self.broken.notify_one();
            // Make sure the old connection is really gone (its consumers must not keep
            // receiving) even if only one operation saw it failing.
            if let (true, Ok(handle)) = (
                link.connection.status().connected(),
                tokio::runtime::Handle::try_current(),
            ) {
                handle.spawn(async move {
                    let _ = link.connection.close(320, "replaced after an error").await;
                });
            }
        }
    }

    /// The current link, waiting for a reconnection until `deadline` (`None`: forever).
    async fn link(&self, deadline: Option<Instant>) -> Result<Arc<Link>> {
        let mut rx = self.state.subscribe();
        loop {
            match &*rx.borrow_and_update() {
                LinkState::Up(link) => return Ok(link.clone()),
                LinkState::Closed => return Err(BusError::Closed),
                LinkState::Down(_) => {}
            }
            let changed = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, rx.changed())
                    .await
                    .map_err(|_| BusError::Unavailable("not connected to the broker".into()))?,
                None => rx.changed().await,
            };
            if changed.is_err() {
                return Err(BusError::Closed);
            }
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn registry_snapshot(&self) -> (Vec<ExchangeSpec>, Vec<QueueSpec>) {
        let registry = self.registry();
        (
            registry.exchanges.values().cloned().collect(),
            registry
                .queues
                .values()
                .map(|(spec, _)| spec.clone())
                .collect(),
        )
    }

    /// Runs `op` on the current link, riding over reconnections and closed channels until the
    /// operation timeout.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T>
    where
        F: FnMut(Arc<Link>) -> Fut,
        Fut: Future<Output = std::result::Result<T, lapin::Error>>,
    {
        let deadline = Instant::now() + self.options.operation_timeout;
        loop {
            let link = self.link(Some(deadline)).await?;
            let error = match op(link.clone()).await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            match classify(&error) {
                Failure::Final(e) => return Err(e),
                Failure::Connection => self.report_broken(link.generation),
                Failure::Channel if !link.connection.status().connected() => {
                    self.report_broken(link.generation)
                }
                Failure::Channel => {}
            }
            if self.is_closed() {
                return Err(BusError::Closed);
            }
            if Instant::now() >= deadline {
                return Err(BusError::Unavailable(format!(
                    "broker operation failed: {error}"
                )));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// One publish attempt on `link`: send, then await the confirm (unless `options` asks
    /// for none: then the broker's silence is taken as an ack).
    async fn publish_on(
        link: &Link,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
    ) -> std::result::Result<Confirmation, lapin::Error> {
        let channel = link.publisher_for(options).await?;
        let mandatory = options.mandatory;
        let confirm = channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory,
                    immediate: false,
                },
                body,
                properties.clone(),
            )
            .await?;
        if options.confirmed() {
            confirm.await
        } else {
            Ok(Confirmation::Ack(None))
        }
    }

    /// Publishes with retries; see [`Bus::publish`].
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
    ) -> Result<()> {
        self.publish_with_properties(exchange, routing_key, body, options, &properties(options))
            .await
    }

    /// [`publish`](Self::publish) with explicit message properties (a replayed dead letter
    /// keeps its publisher's).
    async fn publish_with_properties(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
    ) -> Result<()> {
        check_name(exchange)?;
        check_key(routing_key)?;
        let deadline = Instant::now() + self.options.operation_timeout;
        loop {
            let link = self.link(Some(deadline)).await?;
            let outcome =
                Self::publish_on(&link, exchange, routing_key, body, options, properties).await;
            match self.judge(&link, exchange, routing_key, outcome).await {
                Judged::Done(result) => return result,
                Judged::Retry(reason) => {
                    if self.is_closed() {
                        return Err(BusError::Closed);
                    }
                    if Instant::now() >= deadline {
                        return Err(BusError::Unavailable(format!(
                            "publish not confirmed: {reason}"
                        )));
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Turns the outcome of one publish attempt into a result or a retry.
    async fn judge(
        &self,
        link: &Link,
        exchange: &str,
        routing_key: &str,
        outcome: std::result::Result<Confirmation, lapin::Error>,
    ) -> Judged {
        match outcome {
            Ok(Confirmation::Ack(None)) => Judged::Done(Ok(())),
            Ok(Confirmation::Ack(Some(_returned))) => Judged::Done(Err(BusError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Ok(Confirmation::Nack(_)) => Judged::Done(Err(BusError::Rejected {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Ok(Confirmation::NotRequested) => Judged::Done(Err(BusError::Internal(
                "publisher confirms are not enabled on the channel".into(),
            ))),
            Err(error) => match classify(&error) {
                // A 404 closes the whole publish channel, failing every publish in flight on
                // it: only the one whose exchange is really missing gets the error.
                Failure::Final(BusError::NotFound(text)) => {
                    match self.exchange_exists(link, exchange).await {
                        Some(false) => Judged::Done(Err(BusError::NotFound(text))),
                        _ => Judged::Retry(error.to_string()),
                    }
                }
                Failure::Final(e) => Judged::Done(Err(e)),
                Failure::Connection => {
                    self.report_broken(link.generation);
                    Judged::Retry(error.to_string())
                }
                Failure::Channel => {
                    if !link.connection.status().connected() {
                        self.report_broken(link.generation);
                    }
                    Judged::Retry(error.to_string())
                }
            },
        }
    }

    /// `Some(exists)` from a passive declare; `None` if the broker could not tell.
    async fn exchange_exists(&self, link: &Link, exchange: &str) -> Option<bool> {
        if exchange.is_empty() {
            return Some(true);
        }
        let result = link
            .topology_op(|ch| async move {
                ch.exchange_declare(
                    exchange,
                    lapin::ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
            })
            .await;
        match result {
            Ok(()) => Some(true),
            Err(e) => match classify(&e) {
                Failure::Final(BusError::NotFound(_)) => Some(false),
                _ => None,
            },
        }
    }
}

enum Judged {
    Done(Result<()>),
    Retry(String),
}

/// The header carrying the publish time in epoch milliseconds, read at consume time for
/// `sb_queue_lag_seconds`. The name is that of RabbitMQ's own `rabbitmq_message_timestamp`
/// plugin, so a broker with the plugin enabled and our publishers agree on it (the AMQP
/// `timestamp` property has only whole seconds).
const PUBLISHED_AT_HEADER: &str = "timestamp_in_ms";

fn properties(options: PublishOptions) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        PUBLISHED_AT_HEADER.into(),
        AMQPValue::LongLongInt(epoch_ms()),
    );
    BasicProperties::default()
        .with_delivery_mode(if options.persistent { 2 } else { 1 })
        .with_headers(headers)
}

fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Records the time from publish to consume of one delivery (clock skew between hosts can
/// make it negative: clamped to zero).
fn observe_queue_lag(queue: &str, properties: &BasicProperties) {
    let published =
        properties
            .headers()
            .as_ref()
            .and_then(|h| match h.inner().get(PUBLISHED_AT_HEADER) {
                Some(AMQPValue::LongLongInt(ms)) => Some(*ms),
                _ => None,
            });
    if let Some(ms) = published {
        let lag = (epoch_ms() - ms).max(0) as f64 / 1000.0;
        crate::telemetry::Registry::global().observe(
            crate::telemetry::names::QUEUE_LAG_SECONDS,
            &[("queue", queue)],
            lag,
        );
    }
}

impl AmqpBus {
    /// Connects to the broker (one attempt; a failure is [`BusError::Unavailable`]) and starts
    /// the recovery supervisor. Must be called inside a tokio runtime.
    pub async fn connect(options: AmqpOptions) -> Result<Self> {
        let link = tokio::time::timeout(options.operation_timeout, Link::open(&options, 1))
            .await
            .map_err(|_| BusError::Unavailable("timed out connecting to the broker".into()))?
            .map_err(|e| BusError::Unavailable(format!("cannot connect to the broker: {e}")))?;
        let link = Arc::new(link);
        let (state, _) = watch::channel(LinkState::Up(link.clone()));
        let inner = Arc::new(Inner {
            options,
            state,
            registry: Mutex::default(),
            broken: Arc::new(Notify::new()),
            shutdown: CancellationToken::new(),
            next_consumer: AtomicU64::new(0),
        });
        watch_link(&inner, &link);
        tokio::spawn(supervise(Arc::downgrade(&inner), inner.shutdown.clone()));
        Ok(Self { inner })
    }

    /// Closes the current connection as if the network had dropped it, without closing the
    /// bus: the supervisor reconnects and everything resumes. For recovery tests and chaos
    /// drills.
    pub async fn sever_connection(&self) {
        let link = match &*self.inner.state.borrow() {
            LinkState::Up(link) => link.clone(),
            _ => return,
        };
        let _ = link
            .connection
            .close(320, "severed for a recovery drill")
            .await;
    }

    /// Generation of the current connection (1 for the first, +1 per reconnection); `None`
    /// while reconnecting or closed. For tests and diagnostics.
    pub fn connection_generation(&self) -> Option<u64> {
        match &*self.inner.state.borrow() {
            LinkState::Up(link) => Some(link.generation),
            _ => None,
        }
    }
}

/// Reports the link broken when lapin signals a connection error.
fn watch_link(inner: &Arc<Inner>, link: &Arc<Link>) {
    let weak = Arc::downgrade(inner);
    let generation = link.generation;
    let shutdown = inner.shutdown.clone();
    let mut events = Box::pin(link.connection.events_listener());
    let status = link.connection.status().clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            let Some(inner) = weak.upgrade() else { return };
            match event {
                // lapin reports here too the errors that close a single channel (a 404 on a
                // passive declare, a publish to a missing exchange): the connection is fine,
                // and the operation that caused it gets its own error. Reconnecting would
                // needlessly requeue every subscription's unacked deliveries.
                Some(lapin::Event::Error(error))
                    if status.connected() && matches!(classify(&error), Failure::Final(_)) =>
                {
                    tracing::debug!(%error, generation, "channel error; the connection is up");
                }
                Some(lapin::Event::Error(error)) => {
                    tracing::debug!(%error, generation, "broker connection error");
                    inner.report_broken(generation);
                    return;
                }
                Some(_) => {}
                // The connection is gone.
                None => {
                    inner.report_broken(generation);
                    return;
                }
            }
        }
    });
}

/// Reconnects whenever the link breaks, until shutdown.
async fn supervise(weak: Weak<Inner>, shutdown: CancellationToken) {
    loop {
        {
            let Some(inner) = weak.upgrade() else { return };
            // Holding `inner` across the wait would keep the bus alive; only the Notify is kept.
            let broken = inner.broken.clone();
            drop(inner);
            let notified = broken.notified();
            tokio::pin!(notified);
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                () = &mut notified => {}
                () = tokio::time::sleep(LIVENESS_INTERVAL) => {}
            }
        }
        let Some(inner) = weak.upgrade() else { return };
        let lost = match &*inner.state.borrow() {
            LinkState::Up(link) if !link.connection.status().connected() => Some(link.generation),
            LinkState::Up(_) => None,
            LinkState::Down(generation) => Some(*generation),
            LinkState::Closed => return,
        };
        let Some(lost) = lost else { continue };
        inner.report_broken(lost);
        reconnect(&inner, lost, &shutdown).await;
    }
}

async fn reconnect(inner: &Arc<Inner>, lost: u64, shutdown: &CancellationToken) {
    let mut backoff = backoff::ExponentialBackoffBuilder::new()
        .with_initial_interval(inner.options.reconnect_min)
        .with_max_interval(inner.options.reconnect_max)
        .with_max_elapsed_time(None)
        .build();
    let generation = lost + 1;
    let mut attempt = 0u32;
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        attempt += 1;
        let opened = tokio::time::timeout(
            inner.options.operation_timeout,
            Link::open(&inner.options, generation),
        )
        .await;
        let error = match opened {
            Ok(Ok(link)) => match link.redeclare(inner.registry_snapshot()).await {
                Ok(()) => {
                    let link = Arc::new(link);
                    watch_link(inner, &link);
                    let installed = inner.state.send_if_modified(|state| {
                        if matches!(state, LinkState::Closed) {
                            return false;
                        }
                        *state = LinkState::Up(link.clone());
                        true
                    });
                    if installed {
                        tracing::info!(generation, attempt, "reconnected to the broker");
                    } else {
                        let _ = link.connection.close(200, "bus closed").await;
                    }
                    return;
                }
                Err(e) => e.to_string(),
            },
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".into(),
        };
        let delay = backoff
            .next_backoff()
            .unwrap_or(inner.options.reconnect_max);
        tracing::warn!(%error, attempt, ?delay, "reconnecting to the broker failed");
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

struct AmqpSettler {
    acker: Acker,
    /// Settling on a connection that died silently never completes: bound it.
    timeout: Duration,
}

#[async_trait]
impl Settler for AmqpSettler {
    async fn settle(&self, settlement: Settlement) -> Result<()> {
        let done = tokio::time::timeout(self.timeout, async {
            match settlement {
                Settlement::Ack => self.acker.ack(BasicAckOptions::default()).await,
                Settlement::Nack { requeue } => {
                    self.acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue,
                        })
                        .await
                }
            }
        })
        .await
        .map_err(|_| BusError::Unavailable("timed out settling the delivery".into()))?;
        match done {
            Ok(true) => Ok(()),
            Ok(false) => Err(BusError::Unavailable(
                "the delivery's channel is closed; the broker requeued the message".into(),
            )),
            Err(e) => Err(BusError::Unavailable(format!(
                "cannot settle the delivery: {e}"
            ))),
        }
    }

    fn requeue_on_drop(&self) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let acker = self.acker.clone();
            let timeout = self.timeout;
            handle.spawn(async move {
                let nack = acker.nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                });
                let _ = tokio::time::timeout(timeout, nack).await;
            });
        }
        // Without a runtime the channel closes with the process, which requeues as well.
    }
}

fn convert(delivery: lapin::message::Delivery, timeout: Duration) -> Delivery {
    let header = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-delivery-count").and_then(header_count));
    let delivery_count = header.unwrap_or(u32::from(delivery.redelivered));
    Delivery::new(
        Bytes::from(delivery.data),
        delivery.exchange.as_str().to_owned(),
        delivery.routing_key.as_str().to_owned(),
        delivery.redelivered,
        delivery_count,
        Box::new(AmqpSettler {
            acker: delivery.acker,
            timeout,
        }),
    )
}

/// Opens a subscription channel with its prefetch and starts consuming.
async fn start_consumer(
    link: &Link,
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> std::result::Result<(Channel, lapin::Consumer), lapin::Error> {
    let channel = link.connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions { global: false })
        .await?;
    let consumer = channel
        .basic_consume(
            queue,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

/// Forwards deliveries of one subscription, re-consuming after reconnections, until the
/// subscription is dropped, the bus closed, or the queue deleted.
async fn run_consumer(
    inner: Arc<Inner>,
    queue: String,
    prefetch: u16,
    tag: String,
    tx: mpsc::UnboundedSender<Result<Delivery>>,
    cancel: CancellationToken,
    mut current: Option<(Channel, lapin::Consumer, Arc<Link>)>,
) {
    loop {
        let (channel, mut consumer, link) = match current.take() {
            Some(started) => started,
            None => {
                let link = tokio::select! {
                    biased;
                    () = cancel.cancelled() => break,
                    link = inner.link(None) => match link { Ok(link) => link, Err(_) => break },
                };
                match start_consumer(&link, &queue, prefetch, &tag).await {
                    Ok((channel, consumer)) => (channel, consumer, link),
                    Err(e) => match classify(&e) {
                        Failure::Final(error) => {
                            // The queue is gone (deleted while we were away) or refused us.
                            let _ = tx.send(Err(error));
                            break;
                        }
                        Failure::Connection => {
                            inner.report_broken(link.generation);
                            continue;
                        }
                        Failure::Channel => {
                            if !link.connection.status().connected() {
                                inner.report_broken(link.generation);
                            }
                            tokio::time::sleep(RETRY_PAUSE).await;
                            continue;
                        }
                    },
                }
            }
        };
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    // Closing the channel cancels the consumer and requeues its unacked
                    // deliveries (and auto-deletes an exclusive queue left without consumer).
                    let _ = tokio::time::timeout(
                        inner.options.operation_timeout,
                        channel.close(200, "subscription dropped"),
                    ).await;
                    finish(&inner, &queue);
                    return;
                }
                item = consumer.next() => match item {
                    Some(Ok(delivery)) => {
                        // A send error means the subscription is being dropped: `cancel` follows.
                        observe_queue_lag(&queue, &delivery.properties);
                        let _ = tx.send(Ok(convert(delivery, inner.options.operation_timeout)));
                    }
                    Some(Err(error)) => tracing::debug!(%error, queue, "consumer error"),
                    None => break,
                },
            }
        }
        // The stream ended: connection lost, channel closed, bus closed, or the broker
        // cancelled the consumer because the queue was deleted.
        if inner.is_closed() || cancel.is_cancelled() {
            break;
        }
        if !link.connection.status().connected() {
            inner.report_broken(link.generation);
        } else if channel.status().connected() {
            tracing::info!(queue, "the broker cancelled the consumer (queue deleted)");
            break;
        }
        // Otherwise only the channel closed: consume again on a fresh one.
    }
    finish(&inner, &queue);
}

/// Bookkeeping when a subscription ends: exclusive queues die with their last consumer.
fn finish(inner: &Inner, queue: &str) {
    let mut registry = inner.registry();
    if let Some((spec, consumers)) = registry.queues.get_mut(queue) {
        *consumers = consumers.saturating_sub(1);
        if spec.kind == QueueKind::Exclusive && *consumers == 0 {
            registry.queues.remove(queue);
        }
    }
}

/// Cancels the consumer task when the [`Subscription`] is dropped.
struct ConsumerGuard {
    cancel: CancellationToken,
}

impl Drop for ConsumerGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[async_trait]
impl Bus for AmqpBus {
    async fn declare_exchange(&self, spec: &ExchangeSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "the default exchange cannot be declared".into(),
            ));
        }
        self.inner
            .retrying(|link| async move { link.declare_exchange(spec).await })
            .await?;
        self.inner
            .registry()
            .exchanges
            .insert(spec.name.clone(), spec.clone());
        Ok(())
    }

    async fn delete_exchange(&self, name: &str) -> Result<()> {
        let deleted = self
            .inner
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.exchange_delete(name, ExchangeDeleteOptions::default())
                        .await
                })
                .await
            })
            .await;
        self.inner.registry().exchanges.remove(name);
        match deleted {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn declare_queue(&self, spec: &QueueSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "queue name must not be empty".into(),
            ));
        }
        for binding in &spec.bindings {
            check_key(&binding.routing_key)?;
        }
        self.inner
            .retrying(|link| async move { link.declare_queue(spec).await })
            .await?;
        {
            let mut stored = spec.clone();
            stored.bindings.clear();
            let mut registry = self.inner.registry();
            registry
                .queues
                .entry(spec.name.clone())
                .or_insert((stored, 0));
        }
        for binding in &spec.bindings {
            self.bind(&spec.name, binding).await?;
        }
        Ok(())
    }

    async fn delete_queue(&self, name: &str) -> Result<()> {
        let deleted = self
            .inner
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.queue_delete(name, QueueDeleteOptions::default())
                        .await
                        .map(drop)
                })
                .await
            })
            .await;
        self.inner.registry().queues.remove(name);
        match deleted {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn bind(&self, queue: &str, binding: &Binding) -> Result<()> {
        check_key(&binding.routing_key)?;
        if binding.exchange.is_empty() {
            return Err(BusError::InvalidArgument(
                "queues cannot be bound to the default exchange".into(),
            ));
        }
        self.inner
            .retrying(|link| async move { link.bind(queue, binding).await })
            .await?;
        if let Some((spec, _)) = self.inner.registry().queues.get_mut(queue) {
            if !spec.bindings.contains(binding) {
                spec.bindings.push(binding.clone());
            }
        }
        Ok(())
    }

    async fn unbind(&self, queue: &str, binding: &Binding) -> Result<()> {
        let unbound = self
            .inner
            .retrying(|link| async move {
                link.topology_op(|ch| async move {
                    ch.queue_unbind(
                        queue,
                        binding.exchange.as_str(),
                        binding.routing_key.as_str(),
                        FieldTable::default(),
                    )
                    .await
                })
                .await
            })
            .await;
        if let Some((spec, _)) = self.inner.registry().queues.get_mut(queue) {
            spec.bindings.retain(|b| b != binding);
        }
        match unbound {
            Ok(()) | Err(BusError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
    ) -> Result<()> {
        self.inner
            .publish(exchange, routing_key, &body, options)
            .await
    }

    async fn publish_batch(&self, messages: Vec<Outgoing>) -> Result<(), BatchPublishError> {
        let total = messages.len();
        if total == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + self.inner.options.operation_timeout;
        let link = match self.inner.link(Some(deadline)).await {
            Ok(link) => link,
            Err(e) => {
                let text = e.to_string();
                let closed = matches!(e, BusError::Closed);
                return Err(BatchPublishError::all(total, || {
                    if closed {
                        BusError::Closed
                    } else {
                        BusError::Unavailable(text.clone())
                    }
                }));
            }
        };
        // Send everything, then await every confirm: one round trip for the batch. Unconfirmed
        // messages go on the best-effort channel and are done once sent.
        let confirm_channel = link.publisher().await;
        let best_effort_channel = link.best_effort_publisher().await;
        let mut pending = Vec::with_capacity(total);
        for message in &messages {
            let channel = if message.options.confirmed() {
                &confirm_channel
            } else {
                &best_effort_channel
            };
            let sent = match (
                channel,
                check_name(&message.exchange).and(check_key(&message.routing_key)),
            ) {
                (_, Err(invalid)) => Err(Err(invalid)),
                (Err(e), _) => Err(Ok(e.clone())),
                (Ok(channel), Ok(())) => channel
                    .basic_publish(
                        message.exchange.as_str(),
                        message.routing_key.as_str(),
                        BasicPublishOptions {
                            mandatory: message.options.mandatory,
                            immediate: false,
                        },
                        &message.body,
                        properties(message.options),
                    )
                    .await
                    .map_err(Ok),
            };
            pending.push((sent, message.options.confirmed()));
        }
        let confirms =
            futures::future::join_all(pending.into_iter().map(|(sent, confirmed)| async move {
                match sent {
                    Ok(confirm) if confirmed => Ok(confirm.await),
                    Ok(_) => Ok(Ok(Confirmation::Ack(None))),
                    Err(e) => Err(e),
                }
            }))
            .await;
        let mut failed = Vec::new();
        for (index, (message, confirm)) in messages.iter().zip(confirms).enumerate() {
            let outcome = match confirm {
                Err(Err(invalid)) => Judged::Done(Err(invalid)),
                Err(Ok(send_error)) => {
                    self.inner
                        .judge(
                            &link,
                            &message.exchange,
                            &message.routing_key,
                            Err(send_error),
                        )
                        .await
                }
                Ok(confirmation) => {
                    self.inner
                        .judge(&link, &message.exchange, &message.routing_key, confirmation)
                        .await
                }
            };
            let result = match outcome {
                Judged::Done(result) => result,
                // Lost with the connection or channel: publish it again on its own.
                Judged::Retry(_) => {
                    self.inner
                        .publish(
                            &message.exchange,
                            &message.routing_key,
                            &message.body,
                            message.options,
                        )
                        .await
                }
            };
            if let Err(e) = result {
                failed.push((index, e));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(BatchPublishError { total, failed })
        }
    }

    async fn subscribe(&self, spec: &QueueSpec, options: ConsumeOptions) -> Result<Subscription> {
        self.declare_queue(spec).await?;
        let prefetch = options.prefetch.get();
        let tag = format!(
            "{}#{}",
            self.inner.options.connection_name,
            self.inner.next_consumer.fetch_add(1, Ordering::Relaxed)
        );
        let queue = spec.name.clone();
        let started = {
            let (queue, tag) = (&queue, &tag);
            self.inner
                .retrying(|link| async move {
                    start_consumer(&link, queue, prefetch, tag)
                        .await
                        .map(|(ch, consumer)| (ch, consumer, link))
                })
                .await?
        };
        if let Some((_, consumers)) = self.inner.registry().queues.get_mut(&queue) {
            *consumers += 1;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        tokio::spawn(run_consumer(
            self.inner.clone(),
            queue.clone(),
            prefetch,
            tag,
            tx,
            cancel.clone(),
            Some(started),
        ));
        Ok(Subscription::new(
            queue,
            rx,
            Box::new(ConsumerGuard { cancel }),
        ))
    }

    async fn ping(&self) -> Result<()> {
        match &*self.inner.state.borrow() {
            LinkState::Up(link) if link.connection.status().connected() => Ok(()),
            LinkState::Closed => Err(BusError::Closed),
            _ => Err(BusError::Unavailable("not connected to the broker".into())),
        }
    }

    async fn close(&self) -> Result<()> {
        let previous = self.inner.state.send_replace(LinkState::Closed);
        self.inner.shutdown.cancel();
        if let LinkState::Up(link) = previous {
            let _ = tokio::time::timeout(
                self.inner.options.operation_timeout,
                link.connection.close(200, "bus closed"),
            )
            .await;
            // `close` returns once the broker acknowledged, but lapin's I/O thread notices
            // the closed state on its next turn and then deregisters its socket from the
            // tokio reactor. A process that exits right after `close` tears the reactor down
            // under it, and lapin logs that as an I/O error at every clean shutdown. The
            // thread cannot be joined through lapin's API; a short pause lets it finish.
            tokio::time::sleep(IO_LOOP_SETTLE).await;
        }
        Ok(())
    }
}

/// How long [`AmqpBus::close`] leaves lapin's I/O thread to wind down (see there).
const IO_LOOP_SETTLE: Duration = Duration::from_millis(50);

/// Dead letters on RabbitMQ. Every operation works on a `DeadQueue`: a channel of its own,
/// so the messages it takes unacknowledged are exactly those of this call, and closing it
/// (explicitly, or by the broker when the connection drops) returns whatever it still holds.
///
/// How a queue takes back messages decides how much is taken (see the contract on
/// [`DeadLetters`]): a classic queue puts them back at their original positions, so a peek
/// takes only the head it shows; a quorum queue appends them (RabbitMQ 3.10+ without a
/// delivery limit, which is how the dead queue is declared) or serves them first (with one),
/// so every walk over a quorum queue takes *all* its messages and gives back all it keeps, in
/// order — the one way that leaves the order unchanged under both rules.
#[async_trait]
impl DeadLetters for AmqpBus {
    async fn peek(&self, queue: &QueueSpec, limit: usize) -> Result<DeadLetterList> {
        let mut dead = DeadQueue::open(&self.inner, &queue.name).await?;
        let total = dead.total;
        let take = match queue.effective_queue_type() {
            _ if limit == 0 => 0,
            QueueType::Quorum => total,
            QueueType::Classic => limit.min(total),
        };
        let mut letters = Vec::new();
        let mut failure = None;
        for position in 1..=take {
            match dead.take().await {
                Ok(Some(message)) => {
                    dead.keep(message.delivery.delivery_tag);
                    if letters.len() < limit {
                        letters.push(dead_letter(position, &message.delivery));
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        dead.give_back(total).await;
        match failure {
            Some(error) => Err(error),
            None => Ok(DeadLetterList { total, letters }),
        }
    }

    async fn replay(&self, queue: &QueueSpec, options: &ReplayOptions) -> Result<ReplayReport> {
        let inner = &self.inner;
        let mut dead = DeadQueue::open(inner, &queue.name).await?;
        let mut walk = ReplayWalk::new(options, dead.total);
        let mut taken = 0;
        while walk.wants_more() {
            let message = match dead.take().await {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(error) => {
                    walk.report.interrupted = Some(error);
                    break;
                }
            };
            taken += 1;
            let tag = message.delivery.delivery_tag;
            let letter = dead_letter(taken, &message.delivery);
            let Step::Replay {
                exchange,
                routing_key,
            } = walk.next(&letter)
            else {
                dead.keep(tag);
                continue;
            };
            let properties = replay_properties(&message.delivery.properties);
            let published = inner
                .publish_with_properties(
                    &exchange,
                    &routing_key,
                    &message.delivery.data,
                    // Mandatory and confirmed; the properties are the dead letter's.
                    PublishOptions::default(),
                    &properties,
                )
                .await;
            match published {
                // Confirmed by the broker: only now may the dead copy go.
                Ok(()) => match dead.remove(tag).await {
                    Ok(()) => walk.replayed(),
                    Err(error) => {
                        walk.report.interrupted = Some(BusError::Unavailable(format!(
                            "dead letter {} was replayed but stays in the dead queue too: {error}",
                            letter.id
                        )));
                        break;
                    }
                },
                Err(error) if refusal_is_per_message(&error) => {
                    dead.keep(tag);
                    walk.refused(letter, error);
                }
                Err(error) => {
                    dead.keep(tag);
                    walk.report.interrupted = Some(error);
                    break;
                }
            }
        }
        if queue.effective_queue_type() == QueueType::Quorum && walk.report.interrupted.is_none() {
            // Take the rest too, so that what is given back keeps its order (see above).
            while taken < dead.total {
                match dead.take().await {
                    Ok(Some(message)) => {
                        dead.keep(message.delivery.delivery_tag);
                        taken += 1;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let expected_ready = dead.total.saturating_sub(walk.report.replayed);
        dead.give_back(expected_ready).await;
        Ok(walk.report)
    }

    async fn purge(&self, queue: &QueueSpec) -> Result<u64> {
        let name = queue.name.as_str();
        check_name(name)?;
        let purge = self.inner.retrying(|link| async move {
            link.topology_op(|ch| async move {
                ch.queue_purge(name, QueuePurgeOptions::default()).await
            })
            .await
        });
        let purged = tokio::time::timeout(self.inner.options.operation_timeout, purge)
            .await
            .map_err(|_| BusError::Unavailable(format!("timed out purging {name:?}")))??;
        Ok(u64::from(purged))
    }
}

/// How long giving messages back waits for the queue to count them as ready again: RabbitMQ
/// applies returns to a quorum queue asynchronously, after the nack and even after the
/// channel closed, so a replay started right after a peek could find the queue empty.
const GIVE_BACK_SETTLE: Duration = Duration::from_secs(2);

/// A dead-letter queue opened for one operation: its own channel, the number of ready
/// messages when it was opened, and the messages taken and kept so far.
struct DeadQueue<'a> {
    inner: &'a Inner,
    link: Arc<Link>,
    channel: Channel,
    queue: &'a str,
    /// Ready messages when opened: no walk takes more.
    total: usize,
    /// Highest delivery tag taken and kept (not removed): one `basic.nack(multiple)` up to it
    /// gives back every kept message, in order.
    kept: Option<u64>,
}

impl<'a> DeadQueue<'a> {
    /// Opens a channel and counts the queue (retried over a reconnection: nothing is taken
    /// yet). A missing queue is [`BusError::NotFound`].
    async fn open(inner: &'a Inner, queue: &'a str) -> Result<Self> {
        check_name(queue)?;
        let open = inner.retrying(|link| async move {
            let channel = link.connection.create_channel().await?;
            let declared = channel
                .queue_declare(queue, passive(), FieldTable::default())
                .await?;
            Ok((link, channel, declared.message_count()))
        });
        let (link, channel, total) = tokio::time::timeout(inner.options.operation_timeout, open)
            .await
            .map_err(|_| BusError::Unavailable(format!("timed out opening {queue:?}")))??;
        Ok(Self {
            inner,
            link,
            channel,
            queue,
            total: total as usize,
            kept: None,
        })
    }

    /// Takes the next message unacknowledged (`None`: the queue has no ready message).
    async fn take(&self) -> Result<Option<lapin::message::BasicGetMessage>> {
        self.call(
            self.channel
                .basic_get(self.queue, BasicGetOptions { no_ack: false }),
        )
        .await
    }

    /// Keeps a taken message: it goes back with [`give_back`](Self::give_back).
    fn keep(&mut self, tag: u64) {
        self.kept = self.kept.max(Some(tag));
    }

    /// Removes a taken message for good.
    async fn remove(&self, tag: u64) -> Result<()> {
        self.call(self.channel.basic_ack(tag, BasicAckOptions::default()))
            .await
    }

    /// Gives back every kept message with one `basic.nack(multiple, requeue)` — not
    /// `basic.reject` or a channel close, which RabbitMQ 4.3+ counts as a failed delivery of
    /// the message — waits (at most [`GIVE_BACK_SETTLE`]) until the queue counts
    /// `expected_ready` messages again, and closes the channel (which returns anything still
    /// held if the nack did not go out).
    async fn give_back(self, expected_ready: usize) {
        if let Some(tag) = self.kept {
            let nack = self.channel.basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            );
            if let Err(error) = self.call(nack).await {
                tracing::debug!(%error, queue = self.queue, "giving back dead letters failed; closing the channel returns them");
            }
            let deadline = Instant::now() + GIVE_BACK_SETTLE;
            while Instant::now() < deadline {
                let declared = self
                    .call(
                        self.channel
                            .queue_declare(self.queue, passive(), FieldTable::default()),
                    )
                    .await;
                match declared {
                    Ok(queue) if queue.message_count() as usize >= expected_ready => break,
                    Ok(_) => tokio::time::sleep(RETRY_PAUSE).await,
                    Err(_) => break,
                }
            }
        }
        let closing = self.channel.close(200, "dead letters done");
        let _ = tokio::time::timeout(self.inner.options.operation_timeout, closing).await;
    }

    /// One broker call, bounded by the operation timeout (a connection that died silently
    /// would hang it) and mapped to a [`BusError`].
    async fn call<T>(
        &self,
        call: impl Future<Output = std::result::Result<T, lapin::Error>>,
    ) -> Result<T> {
        let error = match tokio::time::timeout(self.inner.options.operation_timeout, call).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) => error,
            Err(_) => {
                return Err(BusError::Unavailable(
                    "timed out waiting for the broker".into(),
                ));
            }
        };
        match classify(&error) {
            Failure::Final(e) => Err(e),
            failure => {
                if matches!(failure, Failure::Connection)
                    || !self.link.connection.status().connected()
                {
                    self.inner.report_broken(self.link.generation);
                }
                Err(BusError::Unavailable(format!(
                    "broker operation failed: {error}"
                )))
            }
        }
    }
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    }
}

/// A message taken from a dead-letter queue, as a [`DeadLetter`] at `position`.
fn dead_letter(position: usize, delivery: &lapin::message::Delivery) -> DeadLetter {
    let properties = &delivery.properties;
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned());
    DeadLetter {
        position,
        id: message_id
            .clone()
            .unwrap_or_else(|| content_id(&delivery.data)),
        message_id,
        message_type: properties
            .kind()
            .as_ref()
            .map(|kind| kind.as_str().to_owned()),
        death: properties
            .headers()
            .as_ref()
            .and_then(|headers| death_of(headers, delivery.routing_key.as_str())),
        body: Bytes::copy_from_slice(&delivery.data),
    }
}

/// The latest death recorded in a dead letter's headers: the first entry of `x-death` (newest
/// first), else the `x-first-death-*` summary. `routing_key` (the key it was dead-lettered
/// with, the original one) fills in what the entry lacks.
fn death_of(headers: &FieldTable, routing_key: &str) -> Option<Death> {
    let headers = headers.inner();
    let latest = match headers.get("x-death") {
        Some(AMQPValue::FieldArray(deaths)) => {
            deaths.as_slice().iter().find_map(|death| match death {
                AMQPValue::FieldTable(entry) => Some(entry.inner()),
                _ => None,
            })
        }
        _ => None,
    };
    let reason = |value: Option<&AMQPValue>| {
        value.and_then(header_text).map_or_else(
            || DeathReason::Other("unknown".into()),
            |r| DeathReason::parse(&r),
        )
    };
    if let Some(entry) = latest {
        if let Some(exchange) = entry.get("exchange").and_then(header_text) {
            let first_key = match entry.get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => keys.as_slice().first().and_then(header_text),
                _ => None,
            };
            return Some(Death {
                exchange,
                routing_key: first_key.unwrap_or_else(|| routing_key.to_owned()),
                queue: entry.get("queue").and_then(header_text).unwrap_or_default(),
                reason: reason(entry.get("reason")),
                count: entry.get("count").and_then(header_count).unwrap_or(1),
            });
        }
    }
    Some(Death {
        exchange: headers
            .get("x-first-death-exchange")
            .and_then(header_text)?,
        routing_key: routing_key.to_owned(),
        queue: headers
            .get("x-first-death-queue")
            .and_then(header_text)
            .unwrap_or_default(),
        reason: reason(headers.get("x-first-death-reason")),
        count: 1,
    })
}

fn header_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
        _ => None,
    }
}

/// Properties of a replayed dead letter: its publisher's, persistent, minus what is not
/// theirs to give again. The `x-` headers (`x-death`, `x-first-death-*`, `x-delivery-count`)
/// are the broker's bookkeeping of the dead copy: without them the replay is a first delivery
/// (`Delivery::delivery_count` 0, so a consumer's retry backoff starts over). `user-id` would
/// have to match this connection's user, and the broker already removed `expiration` when the
/// message died.
fn replay_properties(original: &BasicProperties) -> BasicProperties {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        properties = properties.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        properties = properties.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        properties = properties.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        properties = properties.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        properties = properties.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        properties = properties.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        properties = properties.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        properties = properties.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        properties = properties.with_app_id(v.clone());
    }
    if let Some(headers) = original.headers() {
        let kept: BTreeMap<_, _> = headers
            .inner()
            .iter()
            .filter(|(name, _)| !name.as_str().starts_with("x-"))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        if !kept.is_empty() {
            properties = properties.with_headers(kept.into());
        }
    }
    properties
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_queue_arguments() {
        let spec = QueueSpec::durable("q")
            .single_active_consumer()
            .delivery_limit(5)
            .dead_letter_exchange("dlx");
        let (options, args) = queue_arguments(&spec);
        assert!(options.durable && !options.exclusive && !options.auto_delete);
        let args = args.inner();
        assert_eq!(
            args.get("x-queue-type"),
            Some(&AMQPValue::LongString("quorum".into()))
        );
        assert_eq!(
            args.get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(5))
        );
        assert_eq!(
            args.get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("dlx".into()))
        );
        assert_eq!(
            args.get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
    }

    #[test]
    fn exclusive_queues_are_classic_without_limit() {
        let spec = QueueSpec::exclusive("gw").delivery_limit(5);
        let (options, args) = queue_arguments(&spec);
        assert!(!options.durable && options.exclusive && options.auto_delete);
        assert!(args.inner().get("x-queue-type").is_none());
        assert!(args.inner().get("x-delivery-limit").is_none());
    }

    #[test]
    fn names_are_extracted_from_reply_texts() {
        assert_eq!(
            extract_name(
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q1' in vhost '/'"
            ),
            "q1"
        );
        assert_eq!(
            extract_name(
                "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'gw' in vhost '/'"
            ),
            "gw"
        );
        assert_eq!(extract_name("no quotes"), "no quotes");
    }

    #[test]
    fn delivery_count_header_values() {
        assert_eq!(header_count(&AMQPValue::LongLongInt(3)), Some(3));
        assert_eq!(header_count(&AMQPValue::LongInt(2)), Some(2));
        assert_eq!(header_count(&AMQPValue::LongLongInt(-1)), None);
        assert_eq!(header_count(&AMQPValue::Boolean(true)), None);
    }

    #[test]
    fn debug_redacts_the_password() {
        let shown = format!(
            "{:?}",
            AmqpOptions::new("amqp://guest:secret@localhost:5672/%2f", "t")
        );
        assert!(!shown.contains("secret"), "{shown}");
    }
}
