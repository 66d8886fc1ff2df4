//! In-process [`Bus`]: exchanges, queues and consumers behind one mutex.
//!
//! This is the embedded-mode bus and the reference implementation of the contract on [`Bus`]:
//! it keeps unacked deliveries per consumer and returns them to their queue position when a
//! subscription is dropped, bounds in-flight deliveries by prefetch, gives single-active-consumer
//! queues to their oldest subscription, counts returns against the delivery limit and
//! dead-letters through the queue's dead-letter exchange (recording where and why, as RabbitMQ's
//! `x-death` does, so [`DeadLetters`] can replay them), and fails mandatory messages nobody is
//! bound for. Nothing is persisted: "durable" means "stored in this process".
//!
//! All state changes happen synchronously under one `std::sync::Mutex` (never held across an
//! `.await`), and deliveries are handed to subscriptions over unbounded channels whose length
//! is bounded by prefetch, so no operation ever waits on a slow consumer.
//!
//! # Layout
//! - this file: [`MemoryBus`], the lock, and the [`Bus`] and [`DeadLetters`] impls, each a
//!   call into the state under the lock; the settler and guard that deliveries and
//!   subscriptions carry;
//! - `state`: the broker state and every synchronous operation on it.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;

mod state;

use self::state::{Consumer, Message, State};
use super::dead_letters::{DeadLetterList, DeadLetters, ReplayOptions, ReplayReport};
use super::{
    BatchPublishError, Binding, Bus, BusError, ConsumeOptions, ExchangeSpec, Outgoing,
    PublishOptions, QueueSpec, QueueUse, Result, Settlement, Settler, Subscription,
};

/// The in-process bus. Cheap to clone; clones share the same exchanges and queues.
#[derive(Clone, Default)]
pub struct MemoryBus {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBus").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
}

impl MemoryBus {
    /// A new, empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        let state = lock(&self.shared);
        if state.closed {
            return Err(BusError::Closed);
        }
        Ok(state)
    }

    /// Number of ready (undelivered) messages in `queue`, for tests and diagnostics.
    pub fn ready_count(&self, queue: &str) -> Option<usize> {
        lock(&self.shared).queues.get(queue).map(|q| q.ready.len())
    }

    /// The bodies of the ready (undelivered) messages in `queue`, in queue order, for tests
    /// and diagnostics.
    pub fn ready_bodies(&self, queue: &str) -> Option<Vec<Bytes>> {
        lock(&self.shared)
            .queues
            .get(queue)
            .map(|q| q.ready.iter().map(|m| m.body.clone()).collect())
    }

    /// Number of delivered but unsettled messages in `queue`, for tests and diagnostics.
    pub fn unacked_count(&self, queue: &str) -> Option<usize> {
        lock(&self.shared)
            .queues
            .get(queue)
            .map(|q| q.unacked.len())
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave the state half-updated in a way that matters
    // more than losing the whole bus, so keep going with the inner value.
    shared
        .state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct MemorySettler {
    shared: Weak<Shared>,
    queue: String,
    tag: u64,
}

#[async_trait]
impl Settler for MemorySettler {
    async fn settle(&self, settlement: Settlement) -> Result<()> {
        let Some(shared) = self.shared.upgrade() else {
            return Err(BusError::Closed);
        };
        let mut state = lock(&shared);
        state.settle(&self.shared, &self.queue, self.tag, settlement)
    }

    fn requeue_on_drop(&self) {
        if let Some(shared) = self.shared.upgrade() {
            let mut state = lock(&shared);
            // Already returned with its subscription: nothing to do.
            let _ = state.settle(
                &self.shared,
                &self.queue,
                self.tag,
                Settlement::Nack { requeue: true },
            );
            // (A dropped delivery counts as a nack: it goes to the back, as on RabbitMQ.)
        }
    }
}

/// Removes the consumer when its [`Subscription`] is dropped.
struct ConsumerGuard {
    shared: Weak<Shared>,
    queue: String,
    id: u64,
}

impl Drop for ConsumerGuard {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            let mut state = lock(&shared);
            state.remove_consumer(&self.shared, &self.queue, self.id);
        }
    }
}

#[async_trait]
impl Bus for MemoryBus {
    async fn declare_exchange(&self, spec: &ExchangeSpec) -> Result<()> {
        self.lock()?.declare_exchange(spec)
    }

    async fn delete_exchange(&self, name: &str) -> Result<()> {
        self.lock()?.exchanges.remove(name);
        Ok(())
    }

    async fn declare_queue(&self, spec: &QueueSpec) -> Result<()> {
        self.lock()?.declare_queue(spec)
    }

    async fn delete_queue(&self, name: &str) -> Result<()> {
        self.lock()?.delete_queue(name);
        Ok(())
    }

    async fn inspect_queue(&self, name: &str) -> Result<Option<QueueUse>> {
        Ok(self.lock()?.inspect_queue(name))
    }

    async fn retire_queue(&self, name: &str) -> Result<()> {
        self.lock()?.retire_queue(name)
    }

    async fn bind(&self, queue: &str, binding: &Binding) -> Result<()> {
        let mut state = self.lock()?;
        state.bind(queue, binding)
    }

    async fn unbind(&self, queue: &str, binding: &Binding) -> Result<()> {
        self.lock()?.unbind(queue, binding)
    }

    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
    ) -> Result<()> {
        let weak = Arc::downgrade(&self.shared);
        self.lock()?
            .publish(&weak, exchange, routing_key, body, options)
    }

    async fn publish_batch(&self, messages: Vec<Outgoing>) -> Result<(), BatchPublishError> {
        let total = messages.len();
        let weak = Arc::downgrade(&self.shared);
        let mut state = self
            .lock()
            .map_err(|_| BatchPublishError::all(total, || BusError::Closed))?;
        let failed: Vec<(usize, BusError)> = messages
            .into_iter()
            .enumerate()
            .filter_map(|(i, m)| {
                state
                    .publish(&weak, &m.exchange, &m.routing_key, m.body, m.options)
                    .err()
                    .map(|e| (i, e))
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(BatchPublishError { total, failed })
        }
    }

    async fn subscribe(&self, spec: &QueueSpec, options: ConsumeOptions) -> Result<Subscription> {
        let weak = Arc::downgrade(&self.shared);
        let mut state = self.lock()?;
        state.declare_queue(spec)?;
        let id = state.next_consumer;
        state.next_consumer += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = state.queues.get_mut(&spec.name).expect("declared above");
        queue.consumers.push(Consumer {
            id,
            prefetch: usize::from(options.prefetch.get()),
            in_flight: 0,
            tx,
        });
        queue.had_consumer = true;
        state.pump(&weak, &spec.name);
        drop(state);
        let guard = ConsumerGuard {
            shared: weak,
            queue: spec.name.clone(),
            id,
        };
        Ok(Subscription::new(spec.name.clone(), rx, Box::new(guard)))
    }

    async fn ping(&self) -> Result<()> {
        self.lock().map(drop)
    }

    async fn close(&self) -> Result<()> {
        let mut state = lock(&self.shared);
        state.closed = true;
        // Dropping every consumer's sender ends the subscriptions with `Closed`.
        for queue in state.queues.values_mut() {
            queue.consumers.clear();
            let returned: Vec<Message> = queue.unacked.drain().map(|(_, (_, m))| m).collect();
            for mut m in returned {
                m.redelivered = true;
                let at = queue.ready.partition_point(|r| r.seq < m.seq);
                queue.ready.insert(at, m);
            }
        }
        Ok(())
    }
}

/// Dead letters are the ready messages of the dead queue, read and removed under the lock:
/// peeking reads them without delivering them (their position and delivery count do not
/// change).
#[async_trait]
impl DeadLetters for MemoryBus {
    async fn peek(&self, queue: &QueueSpec, limit: usize) -> Result<DeadLetterList> {
        let state = self.lock()?;
        let ready = &state.existing_queue(&queue.name)?.ready;
        let letters = ready
            .iter()
            .take(limit)
            .enumerate()
            .map(|(i, m)| m.as_dead_letter(i + 1))
            .collect();
        Ok(DeadLetterList {
            total: ready.len(),
            letters,
        })
    }

    async fn replay(&self, queue: &QueueSpec, options: &ReplayOptions) -> Result<ReplayReport> {
        let weak = Arc::downgrade(&self.shared);
        self.lock()?.replay(&weak, &queue.name, options)
    }

    async fn purge(&self, queue: &QueueSpec) -> Result<u64> {
        let mut state = self.lock()?;
        state.existing_queue(&queue.name)?;
        let queue = state.queues.get_mut(&queue.name).expect("checked above");
        let purged = queue.ready.len() as u64;
        queue.ready.clear();
        Ok(purged)
    }
}
