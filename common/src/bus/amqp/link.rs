//! The link: one AMQP connection with its long-lived channels, its supervisor, and the
//! retry rule every operation rides on.
//!
//! [`Inner`] is what every [`AmqpBus`](super::AmqpBus) clone shares. Its current [`Link`]
//! sits in a `watch` channel ([`LinkState`]): operations take the current link, and when one
//! sees the connection fail it reports the link broken ([`Inner::report_broken`]); the
//! supervisor ([`supervise`]) then reconnects with backoff, re-declares what the registry
//! holds, and only then installs the new link, which wakes every waiting operation and
//! subscription. See "Recovery" in the parent module for the guarantees.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use amqprs::Close;
use amqprs::callbacks::ConnectionCallback;
use amqprs::channel::ConfirmSelectArguments;
use amqprs::connection::{Connection, OpenConnectionArguments};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::AmqpOptions;
use super::channel::{Chan, ClientResult};
use super::confirms::Confirms;
use super::failure::{AmqpError, Failure, classify};
use crate::bus::{BusError, ExchangeSpec, QueueSpec, Result};
use crate::retry::RetryPolicy;

/// How often the supervisor checks that the connection is still up, in addition to the
/// connection's own notice of its end (which a task may subscribe to only after it came).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);
/// Pause between two attempts of an operation that failed on a closed channel.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(20);
/// Pauses between the attempts of an operation that keeps failing on its channel: from
/// [`RETRY_PAUSE`], doubled each time, at most 5 s. Each failure costs a channel the broker
/// closed, and amqprs (2.1) never frees the number of a channel the broker closed: retrying
/// every 20 ms for as long as a queue's home node is down would use up half the connection's
/// channel numbers within a minute, and the bus would replace the connection every minute
/// (see `channel::numbers_running_out`).
pub(super) const CHANNEL_RETRY: RetryPolicy = RetryPolicy::new(RETRY_PAUSE, Duration::from_secs(5));

pub(super) struct Inner {
    pub(super) options: AmqpOptions,
    /// The current link; subscriptions and calls wait on changes.
    pub(super) state: watch::Sender<LinkState>,
    /// Everything declared through this bus, re-declared after a reconnection.
    declarations: Mutex<Declarations>,
    /// Wakes the supervisor when a link looks broken.
    broken: Arc<Notify>,
    /// Cancelled by [`Bus::close`](crate::bus::Bus::close) or when the last handle is dropped.
    pub(super) shutdown: CancellationToken,
    /// Numbers the consumer tags of this connection's subscriptions.
    pub(super) next_consumer: AtomicU64,
    /// The subscriptions' consumer tasks (their cancel tokens are children of `shutdown`),
    /// which [`close`](Inner::close) lets send what their consumers settled before the
    /// connection goes.
    pub(super) consumers: TaskTracker,
}

#[derive(Clone)]
pub(super) enum LinkState {
    /// Connected.
    Up(Arc<Link>),
    /// Reconnecting; the number is the generation of the link that was lost.
    Down(u64),
    /// [`Bus::close`](crate::bus::Bus::close) was called.
    Closed,
}

pub(super) struct Link {
    pub(super) generation: u64,
    pub(super) connection: Connection,
    /// The confirm-mode channel with the bookkeeping that pairs its returns with their owners.
    publish: tokio::sync::Mutex<(Chan, Confirms)>,
    /// Without confirm mode: for unconfirmed messages ([`PublishOptions::confirmed`]).
    best_effort: tokio::sync::Mutex<Chan>,
    topology: tokio::sync::Mutex<Chan>,
}

#[derive(Default)]
pub(super) struct Declarations {
    pub(super) exchanges: BTreeMap<String, ExchangeSpec>,
    /// Queue specs with their *current* bindings, and the number of live subscriptions.
    pub(super) queues: BTreeMap<String, (QueueSpec, usize)>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let LinkState::Up(link) = &*self.state.borrow() {
            let connection = link.connection.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = connection.close().await;
                });
            }
        }
    }
}

/// The connection arguments of an `amqp://user:password@host:port/vhost` URL (the vhost
/// percent-decoded, `/` when the path is empty; port 5672 by default).
fn open_arguments(
    url: &str,
    connection_name: &str,
) -> std::result::Result<OpenConnectionArguments, AmqpError> {
    let invalid = |why: &str| AmqpError::Client(format!("invalid broker URL: {why}"));
    let parsed = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
    if parsed.scheme() != "amqp" {
        return Err(invalid("only amqp:// URLs are supported"));
    }
    let decode = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8()
            .map(|decoded| decoded.into_owned())
            .map_err(|_| invalid("not UTF-8 once percent-decoded"))
    };
    let host = parsed.host_str().ok_or_else(|| invalid("no host"))?;
    let user = match parsed.username() {
        "" => "guest".to_owned(),
        user => decode(user)?,
    };
    let password = decode(parsed.password().unwrap_or("guest"))?;
    let vhost = match parsed.path() {
        "" | "/" => "/".to_owned(),
        path => decode(&path[1..])?,
    };
    let mut arguments =
        OpenConnectionArguments::new(host, parsed.port().unwrap_or(5672), &user, &password);
    arguments
        .virtual_host(&vhost)
        .connection_name(connection_name);
    Ok(arguments)
}

impl Link {
    pub(super) async fn open(
        options: &AmqpOptions,
        generation: u64,
    ) -> std::result::Result<Self, AmqpError> {
        let arguments = open_arguments(&options.url, &options.connection_name)?;
        let connection = Connection::open(&arguments)
            .await
            .map_err(|e| AmqpError::ConnectionLost(e.to_string()))?;
        let publish = Self::publish_channel(&connection).await?;
        let best_effort = Chan::open(&connection, None).await?;
        let topology = Chan::open(&connection, None).await?;
        Ok(Self {
            generation,
            connection,
            publish: tokio::sync::Mutex::new(publish),
            best_effort: tokio::sync::Mutex::new(best_effort),
            topology: tokio::sync::Mutex::new(topology),
        })
    }

    /// A new channel in confirm mode, with the book of its confirms.
    pub(super) async fn publish_channel(
        connection: &Connection,
    ) -> std::result::Result<(Chan, Confirms), AmqpError> {
        let confirms = Confirms::new();
        let chan = Chan::open(connection, Some(confirms.clone())).await?;
        chan.call(
            chan.channel
                .confirm_select(ConfirmSelectArguments::default()),
        )
        .await?;
        Ok((chan, confirms))
    }

    /// The publish channel and its confirms, reopened if a channel error closed it or its
    /// confirms lost track of its numbers. Held (the lock) while a message is written, so the
    /// channel numbers its messages in the order the confirms book them (see `confirms`).
    pub(super) async fn publisher(
        &self,
    ) -> std::result::Result<tokio::sync::MutexGuard<'_, (Chan, Confirms)>, AmqpError> {
        let mut publish = self.publish.lock().await;
        if !publish.0.is_open() || publish.1.is_closed() {
            *publish = Self::publish_channel(&self.connection).await?;
        }
        Ok(publish)
    }

    /// The best-effort channel, reopened if a channel error closed it.
    pub(super) async fn best_effort_publisher(&self) -> std::result::Result<Chan, AmqpError> {
        let mut channel = self.best_effort.lock().await;
        if !channel.is_open() {
            *channel = Chan::open(&self.connection, None).await?;
        }
        Ok(channel.clone())
    }

    /// Runs one operation on the topology channel (serialized; the channel is reopened first
    /// if an earlier error closed it).
    pub(super) async fn topology_op<T, F, Fut>(&self, op: F) -> std::result::Result<T, AmqpError>
    where
        F: FnOnce(Chan) -> Fut,
        Fut: Future<Output = std::result::Result<T, AmqpError>>,
    {
        let mut channel = self.topology.lock().await;
        if !channel.is_open() {
            *channel = Chan::open(&self.connection, None).await?;
        }
        op(channel.clone()).await
    }
}

impl Inner {
    pub(super) fn is_closed(&self) -> bool {
        matches!(*self.state.borrow(), LinkState::Closed)
    }

    /// Marks link `generation` as broken (once) and wakes the supervisor.
    pub(super) fn report_broken(&self, generation: u64) {
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
                link.connection.is_open(),
                tokio::runtime::Handle::try_current(),
            ) {
                let connection = link.connection.clone();
                handle.spawn(async move {
                    let _ = connection.close().await;
                });
            }
        }
    }

    /// The current link, waiting for a reconnection until `deadline` (`None`: forever).
    pub(super) async fn link(&self, deadline: Option<Instant>) -> Result<Arc<Link>> {
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

    pub(super) fn registry(&self) -> std::sync::MutexGuard<'_, Declarations> {
        self.declarations.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn registry_snapshot(&self) -> (Vec<ExchangeSpec>, Vec<QueueSpec>) {
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
    pub(super) async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T>
    where
        F: FnMut(Arc<Link>) -> Fut,
        Fut: Future<Output = std::result::Result<T, AmqpError>>,
    {
        let deadline = Instant::now() + self.options.operation_timeout;
        let mut attempt = 0_u32;
        loop {
            let link = self.link(Some(deadline)).await?;
            let error = match op(link.clone()).await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            match classify(&error) {
                Failure::Final(e) => return Err(e),
                Failure::Connection => self.report_broken(link.generation),
                Failure::Channel if !link.connection.is_open() => {
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
            let pause = CHANNEL_RETRY
                .delay(attempt)
                .min(deadline.saturating_duration_since(Instant::now()));
            tokio::time::sleep(pause).await;
            attempt = attempt.saturating_add(1);
        }
    }

    /// Connects to the broker (one attempt; a failure is [`BusError::Unavailable`]) and
    /// starts the recovery supervisor.
    pub(super) async fn connect(options: AmqpOptions) -> Result<Arc<Self>> {
        let link = tokio::time::timeout(options.operation_timeout, Link::open(&options, 1))
            .await
            .map_err(|_| BusError::Unavailable("timed out connecting to the broker".into()))?
            .map_err(|e| BusError::Unavailable(format!("cannot connect to the broker: {e}")))?;
        let link = Arc::new(link);
        let (state, _) = watch::channel(LinkState::Up(link.clone()));
        let inner = Arc::new(Inner {
            options,
            state,
            declarations: Mutex::default(),
            broken: Arc::new(Notify::new()),
            shutdown: CancellationToken::new(),
            next_consumer: AtomicU64::new(0),
            consumers: TaskTracker::new(),
        });
        watch_link(&inner, &link).await;
        tokio::spawn(supervise(Arc::downgrade(&inner), inner.shutdown.clone()));
        Ok(inner)
    }

    /// Closes the current connection as if the network had dropped it (see
    /// [`AmqpBus::sever_connection`](super::AmqpBus::sever_connection)).
    pub(super) async fn sever_connection(&self) {
        let link = match &*self.state.borrow() {
            LinkState::Up(link) => link.clone(),
            _ => return,
        };
        let _ = link.connection.clone().close().await;
    }

    /// Generation of the current link; `None` while reconnecting or closed.
    pub(super) fn connection_generation(&self) -> Option<u64> {
        match &*self.state.borrow() {
            LinkState::Up(link) => Some(link.generation),
            _ => None,
        }
    }

    /// Whether the current link is up (see [`Bus::ping`](crate::bus::Bus::ping)).
    pub(super) fn ping(&self) -> Result<()> {
        match &*self.state.borrow() {
            LinkState::Up(link) if link.connection.is_open() => Ok(()),
            LinkState::Closed => Err(BusError::Closed),
            _ => Err(BusError::Unavailable("not connected to the broker".into())),
        }
    }

    /// Closes the bus for good (see [`Bus::close`](crate::bus::Bus::close)).
    pub(super) async fn close(&self) -> Result<()> {
        let previous = self.state.send_replace(LinkState::Closed);
        self.shutdown.cancel();
        // Every subscription first sends the acks and nacks its consumer asked for and closes
        // its channel: closing the connection under them would drop those frames, and the
        // broker would deliver the settled messages again after a graceful stop.
        // Each may take two operation timeouts: its settlements, then its channel's close.
        self.consumers.close();
        let _ = tokio::time::timeout(
            self.options.operation_timeout.saturating_mul(2),
            self.consumers.wait(),
        )
        .await;
        if let LinkState::Up(link) = previous {
            let _ = tokio::time::timeout(
                self.options.operation_timeout,
                link.connection.clone().close(),
            )
            .await;
        }
        Ok(())
    }
}

/// Reports the link broken as soon as its connection ends (a network failure, or the broker
/// closing it: the connection's callback hears the broker's reason, and its end is announced
/// to every listener). The supervisor's liveness check catches an end that came before the
/// listener subscribed.
async fn watch_link(inner: &Arc<Inner>, link: &Arc<Link>) {
    let generation = link.generation;
    let callback = ConnectionEnd {
        inner: Arc::downgrade(inner),
        generation,
    };
    if let Err(error) = link.connection.register_callback(callback).await {
        tracing::debug!(%error, generation, "could not watch the connection's close");
    }
    let weak = Arc::downgrade(inner);
    let shutdown = inner.shutdown.clone();
    let connection = link.connection.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = shutdown.cancelled() => {}
            network = connection.listen_network_io_failure() => {
                if let Some(inner) = weak.upgrade() {
                    tracing::debug!(network_failure = network, generation, "the broker connection ended");
                    inner.report_broken(generation);
                }
            }
        }
    });
}

/// The connection's callback: a close by the broker (a forced close, a hard error) breaks the
/// link.
struct ConnectionEnd {
    inner: Weak<Inner>,
    generation: u64,
}

#[async_trait::async_trait]
impl ConnectionCallback for ConnectionEnd {
    async fn close(&mut self, _connection: &Connection, close: Close) -> ClientResult<()> {
        tracing::debug!(generation = self.generation, reason = %close, "the broker closed the connection");
        if let Some(inner) = self.inner.upgrade() {
            inner.report_broken(self.generation);
        }
        Ok(())
    }

    async fn blocked(&mut self, _connection: &Connection, reason: String) {
        tracing::warn!(reason, "the broker blocks publishing (a resource alarm)");
    }

    async fn unblocked(&mut self, _connection: &Connection) {
        tracing::info!("the broker accepts publishing again");
    }

    async fn secret_updated(&mut self, _connection: &Connection) {}
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
            LinkState::Up(link) if !link.connection.is_open() => Some(link.generation),
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
    let mut retry = inner.options.reconnect.start();
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
                    watch_link(inner, &link).await;
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
                        let _ = link.connection.clone().close().await;
                    }
                    return;
                }
                Err(e) => e.to_string(),
            },
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".into(),
        };
        let delay = retry.next_delay();
        tracing::warn!(%error, attempt, ?delay, "reconnecting to the broker failed");
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation failing on its channel for a minute (a queue's home node down) costs a
    /// few dozen channel numbers, not the thousands that pausing 20 ms each time would.
    #[test]
    fn retries_on_a_failing_channel_use_few_channel_numbers_a_minute() {
        let (mut elapsed, mut attempts) = (Duration::ZERO, 0_u32);
        while elapsed < Duration::from_secs(60) {
            elapsed += CHANNEL_RETRY.delay(attempts);
            attempts += 1;
        }
        assert!(attempts <= 20, "{attempts} attempts in a minute");
        // The first retries still come quickly (a quorum queue declared a moment earlier).
        assert_eq!(CHANNEL_RETRY.delay(0), RETRY_PAUSE);
        assert!(CHANNEL_RETRY.delay(3) < Duration::from_millis(200));
    }
}
