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

use futures::StreamExt;
use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::AmqpOptions;
use super::confirms::Confirms;
use super::failure::{Failure, classify};
use crate::bus::{BusError, ExchangeSpec, QueueSpec, Result};

/// How often the supervisor checks that the connection is still up, in addition to lapin's
/// error callback (a client-side close, for instance, does not trigger the callback).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);
/// Pause between two attempts of an operation that failed on a closed channel.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(20);

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
    publish: tokio::sync::Mutex<(Channel, Confirms)>,
    /// Without confirm mode: for unconfirmed messages ([`PublishOptions::confirmed`]).
    best_effort: tokio::sync::Mutex<Channel>,
    topology: tokio::sync::Mutex<Channel>,
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
            let link = link.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = link.connection.close(200, "bus dropped").await;
                });
            }
        }
    }
}

impl Link {
    pub(super) async fn open(
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
    ) -> std::result::Result<(Channel, Confirms), lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok((channel, Confirms::spawn()))
    }

    /// The publish channel and its confirms, reopened if a channel error closed it.
    pub(super) async fn publisher(&self) -> std::result::Result<(Channel, Confirms), lapin::Error> {
        let mut publish = self.publish.lock().await;
        if !publish.0.status().connected() {
            *publish = Self::publish_channel(&self.connection).await?;
        }
        Ok(publish.clone())
    }

    /// The best-effort channel, reopened if a channel error closed it.
    pub(super) async fn best_effort_publisher(&self) -> std::result::Result<Channel, lapin::Error> {
        let mut channel = self.best_effort.lock().await;
        if !channel.status().connected() {
            *channel = self.connection.create_channel().await?;
        }
        Ok(channel.clone())
    }

    /// Runs one operation on the topology channel (serialized; the channel is reopened first
    /// if an earlier error closed it).
    pub(super) async fn topology_op<T, F, Fut>(&self, op: F) -> std::result::Result<T, lapin::Error>
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
        });
        watch_link(&inner, &link);
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
        let _ = link
            .connection
            .close(320, "severed for a recovery drill")
            .await;
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
            LinkState::Up(link) if link.connection.status().connected() => Ok(()),
            LinkState::Closed => Err(BusError::Closed),
            _ => Err(BusError::Unavailable("not connected to the broker".into())),
        }
    }

    /// Closes the bus for good (see [`Bus::close`](crate::bus::Bus::close)).
    pub(super) async fn close(&self) -> Result<()> {
        let previous = self.state.send_replace(LinkState::Closed);
        self.shutdown.cancel();
        if let LinkState::Up(link) = previous {
            let _ = tokio::time::timeout(
                self.options.operation_timeout,
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

/// How long [`Inner::close`] leaves lapin's I/O thread to wind down (see there).
const IO_LOOP_SETTLE: Duration = Duration::from_millis(50);

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
        let delay = retry.next_delay();
        tracing::warn!(%error, attempt, ?delay, "reconnecting to the broker failed");
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}
