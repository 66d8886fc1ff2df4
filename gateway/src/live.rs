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
//! Bindings are reference-counted per run: the first watcher binds, the last one leaving
//! unbinds (in the background, since it happens on drop). Bind and unbind of one run are
//! serialised by a per-run async lock, and the entry is removed only while that lock is
//! held and nobody watches, so a watcher arriving during an unbind rebinds afterwards
//! instead of being left without a binding.
//!
//! Deliveries are best effort by design (the ledger is the source of truth): a slow stream
//! that falls behind its channel gets `Lagged` and re-reads the ledger; if the queue itself
//! is lost (broker restart), streams still make progress through their periodic ledger
//! polls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use sb_common::bus::{Binding, Bus, BusError, ConsumeOptions, QueueSpec, Subscription};
use sb_protocol::ids::RunId;
use sb_protocol::messages::{DecodeError, DeliveryMessage, ResultMessage, decode};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// Items buffered per run for its slowest stream before it lags (and re-reads the ledger).
const RUN_CHANNEL_CAPACITY: usize = 256;

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
    runs: Mutex<HashMap<RunId, RunEntry>>,
}

struct RunEntry {
    sender: broadcast::Sender<Arc<DeliveryMessage>>,
    /// Live [`Watch`]es of this run.
    watchers: usize,
    /// The run's binding is on the queue.
    bound: bool,
    /// Serialises bind/unbind of this run (held across the broker calls).
    op: Arc<tokio::sync::Mutex<()>>,
}

/// A stream's registration for one run. Dropping it unregisters (and unbinds when it was
/// the last one).
pub struct Watch {
    receiver: broadcast::Receiver<Arc<DeliveryMessage>>,
    _guard: WatchGuard,
}

impl Watch {
    /// The next live item of the run. `Err(Lagged)` means items were skipped (read the
    /// ledger); `Err(Closed)` means the hub stopped (rely on the ledger).
    pub async fn recv(&mut self) -> Result<Arc<DeliveryMessage>, broadcast::error::RecvError> {
        self.receiver.recv().await
    }
}

struct WatchGuard {
    hub: LiveHub,
    run_id: RunId,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let last = {
            let mut runs = self.hub.lock();
            match runs.get_mut(&self.run_id) {
                Some(entry) => {
                    entry.watchers = entry.watchers.saturating_sub(1);
                    entry.watchers == 0
                }
                None => false,
            }
        };
        if last {
            let hub = self.hub.clone();
            let run_id = self.run_id;
            // Drop cannot await; the cleanup re-checks under the run's lock, so it is
            // harmless if a new watcher arrives before it runs.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { hub.cleanup(run_id).await });
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
        tokio::spawn(async move { fan_out.consume(subscription, shutdown).await });
        Ok(hub)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RunId, RunEntry>> {
        // Every critical section is a few map operations that cannot leave it inconsistent.
        self.inner.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn binding(&self, pattern: String) -> Binding {
        Binding::new(self.inner.exchange.clone(), pattern)
    }

    /// Registers interest in `run_id` and returns once live items of the run are routed to
    /// this gateway (the binding `*.*.<run_id>` is on the queue).
    pub async fn watch(&self, run_id: RunId) -> Result<Watch, BusError> {
        let (receiver, op) = {
            let mut runs = self.lock();
            let entry = runs.entry(run_id).or_insert_with(|| RunEntry {
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
            run_id,
        };
        let _op = op.lock().await;
        // The entry cannot have been removed: removal needs `watchers == 0`.
        let needs_bind = self.lock().get(&run_id).is_some_and(|e| !e.bound);
        if needs_bind {
            let binding = self.binding(sb_common::bus::topology::deliveries_run_pattern(&run_id));
            self.inner
                .bus
                .bind(&self.inner.queue.name, &binding)
                .await?;
            if let Some(entry) = self.lock().get_mut(&run_id) {
                entry.bound = true;
            }
        }
        Ok(Watch {
            receiver,
            _guard: guard,
        })
    }

    /// Unbinds and forgets `run_id` if nobody watches it any more.
    async fn cleanup(&self, run_id: RunId) {
        let Some(op) = self.lock().get(&run_id).map(|e| Arc::clone(&e.op)) else {
            return;
        };
        let _op = op.lock().await;
        let bound = {
            let mut runs = self.lock();
            match runs.get(&run_id) {
                Some(entry) if entry.watchers > 0 => return,
                Some(entry) if !entry.bound => {
                    runs.remove(&run_id);
                    return;
                }
                Some(_) => true,
                None => return,
            }
        };
        if bound {
            let binding = self.binding(sb_common::bus::topology::deliveries_run_pattern(&run_id));
            if let Err(error) = self
                .inner
                .bus
                .unbind(&self.inner.queue.name, &binding)
                .await
            {
                // A stale binding only costs a few unwanted messages (dropped on arrival);
                // it disappears with the queue.
                tracing::warn!(%run_id, %error, "cannot unbind a finished live stream");
            }
        }
        let mut runs = self.lock();
        if let Some(entry) = runs.get_mut(&run_id) {
            if entry.watchers == 0 {
                runs.remove(&run_id);
            } else {
                // A watcher arrived during the unbind and waits for `op`: it will rebind.
                entry.bound = false;
            }
        }
    }

    /// Number of runs with live watchers or pending cleanup (diagnostics, tests).
    pub fn watched_runs(&self) -> usize {
        self.lock().len()
    }

    /// Name of the exclusive queue.
    pub fn queue_name(&self) -> &str {
        &self.inner.queue.name
    }

    /// Hands every delivery to the watchers of its run, then acks it.
    async fn consume(self, mut subscription: Subscription, shutdown: CancellationToken) {
        loop {
            let delivery = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                delivery = subscription.next() => delivery,
            };
            let delivery = match delivery {
                Ok(delivery) => delivery,
                Err(BusError::Closed) => {
                    tracing::info!("live delivery queue closed");
                    break;
                }
                Err(error) => {
                    tracing::warn!(%error, "live delivery consumer error");
                    continue;
                }
            };
            match decode_delivery(&delivery.body) {
                Ok(message) => {
                    let sender = self.lock().get(&message.run_id).map(|e| e.sender.clone());
                    if let Some(sender) = sender {
                        // No receiver left is fine: the stream just ended.
                        let _ = sender.send(Arc::new(message));
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, routing_key = %delivery.routing_key, "undecodable live delivery dropped");
                }
            }
            // Live items are not worth redelivering: the ledger has them.
            if let Err(error) = delivery.ack().await {
                tracing::debug!(%error, "live delivery ack failed");
            }
        }
        // Wake every stream so it stops waiting for live items and relies on the ledger.
        self.lock().clear();
    }
}

/// Decodes a live item: a `switchboard.delivery/1` body, or a `switchboard.result/1` body
/// (same shape; accepted so a sink that forwards result messages as they are still works).
pub fn decode_delivery(body: &[u8]) -> Result<DeliveryMessage, DecodeError> {
    match decode::<DeliveryMessage>(body) {
        Err(DecodeError::WrongSchema { .. }) => {
            decode::<ResultMessage>(body).map(DeliveryMessage::from)
        }
        other => other,
    }
}
