//! RabbitMQ [`Bus`] on amqprs (feature `amqp`).
//!
//! amqprs runs each connection's reader and writer as Tokio tasks, so a publish, a delivery
//! and an ack are handed between tasks of the role's own runtime; lapin, the client before
//! it, ran every connection's I/O on a thread of its own, and each of those crossed threads
//! (`scripts/amqp-clients` measures both: 4 × the client CPU per hop, 8 × the context
//! switches).
//!
//! # Shape
//! One AMQP connection per [`AmqpBus`] (a "link"), with:
//! - a **publish channel** in confirm mode: every publish is persistent (delivery mode 2) unless
//!   asked otherwise, `mandatory` by default, and awaited until the broker's ack; a batch
//!   sends every message and then awaits every confirm (one round trip for the batch); a
//!   returned (unroutable) message is reported to its own publisher, not to whichever
//!   message's ack the client read next (see `confirms`);
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
//! A supervisor task watches the link (the connection's end, failed operations, and a
//! periodic liveness check). When the connection is lost it reconnects with exponential
//! backoff (the one retry policy, [`AmqpOptions::reconnect`]),
//! re-declares every exchange, queue and binding declared through this bus (including
//! exclusive queues, which died with the old connection, with their current bindings), and
//! only then publishes the new link. Meanwhile:
//! - calls wait for the new link and retry (declarations are idempotent; an unconfirmed
//!   publish is published again, so a message may be duplicated — never lost) until
//!   [`AmqpOptions::operation_timeout`], then fail with [`BusError::Unavailable`](super::BusError::Unavailable);
//! - each live subscription re-opens its channel and consumer on the new link; the
//!   deliveries it had not settled were requeued by the broker, and settling them fails with
//!   [`BusError::Unavailable`](super::BusError::Unavailable) (they come again, with `redelivered` set).
//!
//! # Layout
//! - this file: [`AmqpOptions`], [`AmqpBus`] and its [`Bus`] impl, which only delegates;
//! - `link`: the connection and its long-lived channels, the shared state every clone
//!   holds, the supervisor that reconnects, and the retry rule of every operation;
//! - `failure`: what a failed broker call means (reconnect, new channel, or final answer);
//! - `declare`: exchanges, queues and bindings, and the registry replayed after a reconnection;
//! - `publish`: confirmed and best-effort publishing, one message or a batch;
//! - `channel`: a channel with what the broker told its callback (why it closed, a cancelled
//!   consumer), the confirms and returns of the publish channel passed on;
//! - `confirms`: the book that pairs each confirmation with its own message's return;
//! - `consume`: subscriptions, their consumer tasks, and settling deliveries;
//! - `properties`: the properties and headers we publish with and read back;
//! - `dead_letters`: [`DeadLetters`](super::dead_letters::DeadLetters) on RabbitMQ.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    BatchPublishError, Binding, Bus, ConsumeOptions, ExchangeSpec, Outgoing, PublishOptions,
    QueueSpec, QueueUse, Result, Subscription,
};

mod channel;
mod confirms;
mod consume;
mod dead_letters;
mod declare;
mod failure;
mod link;
mod properties;
mod publish;
mod settle;

use link::Inner;

use crate::retry::{RetryConfig, RetryPolicy};

/// Connection options of [`AmqpBus`]; the config layer maps its bus section onto this.
#[derive(Clone)]
pub struct AmqpOptions {
    /// `amqp://user:password@host:port/vhost` (`%2f` is the default vhost).
    pub url: String,
    /// Shown by the broker (`rabbitmqctl list_connections client_properties`); include the
    /// role and host so an operator can tell connections apart.
    pub connection_name: String,
    /// How long a call waits for the broker (including reconnection) before failing with
    /// [`BusError::Unavailable`](super::BusError::Unavailable).
    pub operation_timeout: Duration,
    /// Delays between reconnection attempts (the configuration's `[retry]`).
    pub reconnect: RetryPolicy,
}

impl AmqpOptions {
    /// Options for `url` with defaults: 30 s operation timeout, reconnect every 100 ms
    /// doubling up to 5 s.
    pub fn new(url: impl Into<String>, connection_name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            connection_name: connection_name.into(),
            operation_timeout: super::DEFAULT_OPERATION_TIMEOUT,
            reconnect: RetryConfig::default().policy(),
        }
    }
}

impl std::fmt::Debug for AmqpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password.
        let url = crate::config::redact_url(&self.url);
        f.debug_struct("AmqpOptions")
            .field("url", &url)
            .field("connection_name", &self.connection_name)
            .field("operation_timeout", &self.operation_timeout)
            .field("reconnect", &self.reconnect)
            .finish()
    }
}

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

impl AmqpBus {
    /// Connects to the broker (one attempt; a failure is [`BusError::Unavailable`](super::BusError::Unavailable)) and starts
    /// the recovery supervisor. Must be called inside a tokio runtime.
    pub async fn connect(options: AmqpOptions) -> Result<Self> {
        Ok(Self {
            inner: Inner::connect(options).await?,
        })
    }

    /// Closes the current connection as if the network had dropped it, without closing the
    /// bus: the supervisor reconnects and everything resumes. For recovery tests and chaos
    /// drills.
    pub async fn sever_connection(&self) {
        self.inner.sever_connection().await;
    }

    /// Generation of the current connection (1 for the first, +1 per reconnection); `None`
    /// while reconnecting or closed. For tests and diagnostics.
    pub fn connection_generation(&self) -> Option<u64> {
        self.inner.connection_generation()
    }
}

#[async_trait]
impl Bus for AmqpBus {
    async fn declare_exchange(&self, spec: &ExchangeSpec) -> Result<()> {
        self.inner.declare_exchange(spec).await
    }

    async fn delete_exchange(&self, name: &str) -> Result<()> {
        self.inner.delete_exchange(name).await
    }

    async fn declare_queue(&self, spec: &QueueSpec) -> Result<()> {
        self.inner.declare_queue(spec).await
    }

    async fn delete_queue(&self, name: &str) -> Result<()> {
        self.inner.delete_queue(name).await
    }

    async fn inspect_queue(&self, name: &str) -> Result<Option<QueueUse>> {
        self.inner.inspect_queue(name).await
    }

    async fn retire_queue(&self, name: &str) -> Result<()> {
        self.inner.retire_queue(name).await
    }

    async fn bind(&self, queue: &str, binding: &Binding) -> Result<()> {
        self.inner.bind(queue, binding).await
    }

    async fn unbind(&self, queue: &str, binding: &Binding) -> Result<()> {
        self.inner.unbind(queue, binding).await
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
        self.inner.publish_batch(messages).await
    }

    async fn subscribe(&self, spec: &QueueSpec, options: ConsumeOptions) -> Result<Subscription> {
        self.inner.subscribe(spec, options).await
    }

    async fn ping(&self) -> Result<()> {
        self.inner.ping()
    }

    async fn close(&self) -> Result<()> {
        self.inner.close().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_the_password() {
        let shown = format!(
            "{:?}",
            AmqpOptions::new("amqp://guest:secret@localhost:5672/%2f", "t")
        );
        assert!(!shown.contains("secret"), "{shown}");
    }
}
