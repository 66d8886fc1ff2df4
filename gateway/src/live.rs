//! Live delivery: the gateway's one exclusive delivery queue and the in-process fan-out of
//! its messages to the streams that watch a run (SPEC §2 step 5, §3).
//!
//! ```text
//!  switchboard.deliveries (topic) ──binding per watched run──▶ <gateway queue> (exclusive)
//!                                                                    │ consumer task
//!                                                                    ▼
//!                                             runs: run_id ──▶ broadcast channel ──▶ streams
//! ```
//!
//! A stream calls [`LiveHub::watch`] **before** it reads the ledger: `watch` returns only
//! once the binding for the run is in place on the broker, so every item persisted after the
//! ledger read is published to a bound queue and reaches the stream. The stream then drops
//! what it already sent (by sequence) and fills gaps from the ledger (see `stream.rs`).
//!
//! [`LiveHub::watch_conversation`] does the same for every run of one conversation
//! (`<workspace>.<conversation>.*`): `POST /v1/events?stream=true` binds it before the event
//! is routed, so the run's first item both tells the stream that the event has been routed
//! (no polling of the event log) and is already covered by a binding when the stream reads
//! the ledger.
//!
//! Bindings are reference-counted per watched key (a run or a conversation): the first
//! watcher binds, the last one leaving unbinds (in the background, since it happens on drop;
//! a conversation's binding lingers a few seconds for the conversation's next message).
//! Bind and unbind of one key are serialised by a per-key async lock, and the entry is
//! removed only while that lock is held and nobody watches, so a watcher arriving during an
//! unbind rebinds afterwards instead of being left without a binding.
//!
//! Deliveries are best effort by design (the ledger is the source of truth): a slow stream
//! that falls behind its channel gets `Lagged` and re-reads the ledger; if the queue itself
//! is lost (broker restart), streams still make progress through their periodic ledger
//! polls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use sb_common::bus::consumer::{ConsumeLoop, Ended, settle};
use sb_common::bus::{
    Binding, Bus, BusError, ConsumeOptions, Delivery, QueueSpec, Settlement, Subscription,
};
use sb_common::retry::RetryConfig;
use sb_protocol::ids::RunId;
use sb_protocol::messages::{LiveDelivery, LiveItem, decode_live};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// Items buffered per run for its slowest stream before it lags (and re-reads the ledger).
const RUN_CHANNEL_CAPACITY: usize = 256;

/// How long a conversation's binding outlives its last watcher. Conversations come back (the
/// next message of a chat), and a binding still in place spares that stream a bind and the
/// broker an unbind and a bind (on RabbitMQ each is a metadata transaction); meanwhile the
/// conversation's items reach this gateway unwatched and are dropped on arrival.
const CONVERSATION_LINGER: std::time::Duration = std::time::Duration::from_secs(10);

/// The live-delivery hub of one gateway process. Cheap to clone.
#[derive(Clone)]
pub struct LiveHub {
    inner: Arc<HubInner>,
}

struct HubInner {
    bus: Arc<dyn Bus>,
    /// The exclusive queue, as declared.
    queue: QueueSpec,
    /// `switchboard.deliveries` (with the deployment prefix).
    exchange: String,
    runs: Mutex<HashMap<WatchKey, RunEntry>>,
}

/// What a [`Watch`] follows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum WatchKey {
    /// One run (`*.*.<run_id>`).
    Run(RunId),
    /// Every run of one conversation: the binding pattern `<workspace>.<conversation or _>.*`.
    Conversation(String),
}

impl WatchKey {
    fn conversation(workspace: &str, conversation: Option<&str>) -> Self {
        Self::Conversation(sb_common::bus::topology::deliveries_conversation_pattern(
            workspace,
            conversation,
        ))
    }

    fn pattern(&self) -> String {
        match self {
            Self::Run(run_id) => sb_common::bus::topology::deliveries_run_pattern(run_id),
            Self::Conversation(pattern) => pattern.clone(),
        }
    }
}

struct RunEntry {
    sender: broadcast::Sender<Arc<LiveItem>>,
    /// Live [`Watch`]es of this run.
    watchers: usize,
    /// The run's binding is on the queue.
    bound: bool,
    /// Serialises bind/unbind of this run (held across the broker calls).
    op: Arc<tokio::sync::Mutex<()>>,
}

/// A stream's registration for one run or one conversation. Dropping it unregisters (and
/// unbinds when it was the last one).
pub struct Watch {
    receiver: broadcast::Receiver<Arc<LiveItem>>,
    guard: WatchGuard,
}

impl Watch {
    /// The next live item of the watched run (of any run of the watched conversation).
    /// `Err(Lagged)` means items were skipped (read the ledger); `Err(Closed)` means the hub
    /// stopped (rely on the ledger).
    pub async fn recv(&mut self) -> Result<Arc<LiveItem>, broadcast::error::RecvError> {
        self.receiver.recv().await
    }

    /// Appends the items already received to `into`, without waiting. Items were skipped
    /// (lag) before the ones appended last: what `into` held before the lag is dropped, so
    /// it always ends with items received without a gap.
    pub fn drain_into(&mut self, into: &mut Vec<Arc<LiveItem>>) -> Drained {
        let mut drained = Drained::Complete;
        loop {
            match self.receiver.try_recv() {
                Ok(message) => into.push(message),
                Err(broadcast::error::TryRecvError::Lagged(_)) => {
                    into.clear();
                    drained = Drained::Lagged;
                }
                Err(broadcast::error::TryRecvError::Empty) => return drained,
                Err(broadcast::error::TryRecvError::Closed) => return Drained::Closed,
            }
        }
    }

    /// Whether the live items of run `run_id` (of `workspace`, in `conversation`) reach this
    /// watch.
    #[must_use]
    pub fn covers(&self, run_id: RunId, workspace: &str, conversation: Option<&str>) -> bool {
        match &self.guard.key {
            WatchKey::Run(id) => *id == run_id,
            WatchKey::Conversation(_) => self.covers_conversation(workspace, conversation),
        }
    }

    /// Whether this watch follows every run of `conversation` (of `workspace`).
    #[must_use]
    pub fn covers_conversation(&self, workspace: &str, conversation: Option<&str>) -> bool {
        self.guard.key == WatchKey::conversation(workspace, conversation)
    }
}

/// How [`Watch::drain_into`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every item received since the last call was appended.
    Complete,
    /// Items were skipped (lag); those appended came after the gap.
    Lagged,
    /// The hub stopped: no more live items will come.
    Closed,
}

struct WatchGuard {
    hub: LiveHub,
    key: WatchKey,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let last = {
            let mut runs = self.hub.lock();
            match runs.get_mut(&self.key) {
                Some(entry) => {
                    entry.watchers = entry.watchers.saturating_sub(1);
                    entry.watchers == 0
                }
                None => false,
            }
        };
        if last {
            let hub = self.hub.clone();
            let key = self.key.clone();
            let linger = match key {
                WatchKey::Run(_) => None,
                WatchKey::Conversation(_) => Some(CONVERSATION_LINGER),
            };
            // Drop cannot await; the cleanup re-checks under the key's lock, so it is
            // harmless if a new watcher arrives before it runs (or during the linger).
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if let Some(linger) = linger {
                        tokio::time::sleep(linger).await;
                    }
                    hub.cleanup(key).await;
                });
            }
        }
    }
}

impl LiveHub {
    /// Declares the gateway's exclusive queue (`queue`, bound to nothing yet), starts
    /// consuming it, and spawns the fan-out task, which runs until `shutdown`.
    pub async fn start(
        bus: Arc<dyn Bus>,
        queue: QueueSpec,
        exchange: String,
        prefetch: u16,
        shutdown: CancellationToken,
    ) -> Result<Self, BusError> {
        let subscription = bus
            .subscribe(&queue, ConsumeOptions::prefetch(prefetch))
            .await?;
        let hub = Self {
            inner: Arc::new(HubInner {
                bus,
                queue,
                exchange,
                runs: Mutex::new(HashMap::new()),
            }),
        };
        let fan_out = hub.clone();
        tokio::spawn(async move { fan_out.consume(subscription, prefetch, shutdown).await });
        Ok(hub)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<WatchKey, RunEntry>> {
        // Every critical section is a few map operations that cannot leave it inconsistent.
        self.inner.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn binding(&self, pattern: String) -> Binding {
        Binding::new(self.inner.exchange.clone(), pattern)
    }

    /// Registers interest in `run_id` and returns once live items of the run are routed to
    /// this gateway (the binding `*.*.<run_id>` is on the queue).
    pub async fn watch(&self, run_id: RunId) -> Result<Watch, BusError> {
        self.watch_key(WatchKey::Run(run_id)).await
    }

    /// Registers interest in every run of a conversation and returns once their live items
    /// are routed to this gateway (the binding `<workspace>.<conversation or _>.*` is on the
    /// queue). Items of other runs of the conversation arrive too: filter by run id.
    pub async fn watch_conversation(
        &self,
        workspace: &str,
        conversation: Option<&str>,
    ) -> Result<Watch, BusError> {
        self.watch_key(WatchKey::conversation(workspace, conversation))
            .await
    }

    async fn watch_key(&self, key: WatchKey) -> Result<Watch, BusError> {
        let (receiver, op) = {
            let mut runs = self.lock();
            let entry = runs.entry(key.clone()).or_insert_with(|| RunEntry {
                sender: broadcast::channel(RUN_CHANNEL_CAPACITY).0,
                watchers: 0,
                bound: false,
                op: Arc::new(tokio::sync::Mutex::new(())),
            });
            entry.watchers += 1;
            (entry.sender.subscribe(), Arc::clone(&entry.op))
        };
        // From here on, dropping the guard undoes the registration (also on error).
        let guard = WatchGuard {
            hub: self.clone(),
            key: key.clone(),
        };
        let _op = op.lock().await;
        // The entry cannot have been removed: removal needs `watchers == 0`.
        let needs_bind = self.lock().get(&key).is_some_and(|e| !e.bound);
        if needs_bind {
            let binding = self.binding(key.pattern());
            self.inner
                .bus
                .bind(&self.inner.queue.name, &binding)
                .await?;
            if let Some(entry) = self.lock().get_mut(&key) {
                entry.bound = true;
            }
        }
        Ok(Watch { receiver, guard })
    }

    /// Unbinds and forgets `key` if nobody watches it any more.
    async fn cleanup(&self, key: WatchKey) {
        let Some(op) = self.lock().get(&key).map(|e| Arc::clone(&e.op)) else {
            return;
        };
        let _op = op.lock().await;
        let bound = {
            let mut runs = self.lock();
            match runs.get(&key) {
                Some(entry) if entry.watchers > 0 => return,
                Some(entry) if !entry.bound => {
                    runs.remove(&key);
                    return;
                }
                Some(_) => true,
                None => return,
            }
        };
        if bound {
            let binding = self.binding(key.pattern());
            if let Err(error) = self
                .inner
                .bus
                .unbind(&self.inner.queue.name, &binding)
                .await
            {
                // A stale binding only costs a few unwanted messages (dropped on arrival);
                // it disappears with the queue.
                tracing::warn!(?key, %error, "cannot unbind a finished live stream");
            }
        }
        let mut runs = self.lock();
        if let Some(entry) = runs.get_mut(&key) {
            if entry.watchers == 0 {
                runs.remove(&key);
            } else {
                // A watcher arrived during the unbind and waits for `op`: it will rebind.
                entry.bound = false;
            }
        }
    }

    /// Number of watched runs and conversations, with live watchers or pending cleanup
    /// (diagnostics, tests).
    pub fn watched_runs(&self) -> usize {
        self.lock().len()
    }

    /// Name of the exclusive queue.
    pub fn queue_name(&self) -> &str {
        &self.inner.queue.name
    }

    /// Hands each item of `delivery` to the streams watching its run or its conversation,
    /// in order. The items of one delivery are of one run, so its watchers are looked up
    /// once.
    fn fan_out(&self, delivery: LiveDelivery) {
        let Some(first) = delivery.items.first() else {
            return;
        };
        let conversation = WatchKey::conversation(
            delivery.workspace_id.as_str(),
            delivery.conversation_id.as_deref(),
        );
        let senders: Vec<_> = {
            let runs = self.lock();
            [
                runs.get(&WatchKey::Run(first.run_id)),
                runs.get(&conversation),
            ]
            .into_iter()
            .flatten()
            .map(|e| e.sender.clone())
            .collect()
        };
        if senders.is_empty() {
            return;
        }
        for item in delivery.items {
            let item = Arc::new(item);
            for sender in &senders {
                // No receiver left is fine: the stream just ended.
                let _ = sender.send(Arc::clone(&item));
            }
        }
    }

    /// Fans the deliveries out until `shutdown` or until the queue is lost (through the
    /// shared consume loop, [`ConsumeLoop`]). Not subscribed again: the exclusive queue and
    /// its bindings went with the subscription.
    async fn consume(self, subscription: Subscription, prefetch: u16, shutdown: CancellationToken) {
        let retry = RetryConfig::default().policy();
        let consumer = ConsumeLoop {
            bus: self.inner.bus.as_ref(),
            queue: &self.inner.queue,
            prefetch,
            max_batch: usize::from(prefetch),
            retry,
        };
        let queue = self.inner.queue.name.as_str();
        let mut handle = |batch: Vec<Delivery>| {
            let (hub, shutdown, retry) = (&self, &shutdown, &retry);
            async move {
                for delivery in batch {
                    match decode_live(&delivery.body) {
                        Ok(items) => hub.fan_out(items),
                        Err(error) => {
                            tracing::warn!(%error, routing_key = %delivery.routing_key, "undecodable live delivery dropped");
                        }
                    }
                    // Live items are not worth redelivering: the ledger has them.
                    settle(delivery, Settlement::Ack, queue, retry, shutdown).await;
                }
            }
        };
        if let Ended::Lost = consumer
            .run_subscription(subscription, &shutdown, &mut handle)
            .await
        {
            tracing::info!("live delivery queue closed");
        }
        // Wake every stream so it stops waiting for live items and relies on the ledger.
        self.lock().clear();
    }
}
