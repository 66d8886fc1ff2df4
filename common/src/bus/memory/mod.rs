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

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;

use super::dead_letters::{
    DeadLetter, DeadLetterList, DeadLetters, Death, DeathReason, ReplayOptions, ReplayReport,
    ReplayWalk, Step, content_id, refusal_is_per_message,
};
use super::{
    BatchPublishError, Binding, Bus, BusError, ConsumeOptions, Delivery, ExchangeKind,
    ExchangeSpec, Outgoing, PublishOptions, QueueKind, QueueSpec, Result, Settlement, Settler,
    Subscription, check_key, check_name, topic_matches,
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

#[derive(Default)]
struct State {
    closed: bool,
    exchanges: HashMap<String, Exchange>,
    queues: HashMap<String, Queue>,
    /// Delivery tags and consumer ids are global so a tag can never be confused with one of a
    /// deleted-and-redeclared queue of the same name.
    next_tag: u64,
    next_consumer: u64,
}

struct Exchange {
    kind: ExchangeKind,
    /// (binding key, queue name).
    bindings: BTreeSet<(String, String)>,
}

struct Queue {
    spec: QueueSpec,
    /// Ready messages in queue order (ascending `seq`).
    ready: VecDeque<Message>,
    /// Delivered, not yet settled, by delivery tag.
    unacked: HashMap<u64, (u64, Message)>,
    /// Registration order; on a single-active-consumer queue the first one is the active one.
    consumers: Vec<Consumer>,
    /// Round-robin cursor over `consumers`.
    cursor: usize,
    next_seq: u64,
    /// Auto-delete only triggers once a queue has had a consumer (as in RabbitMQ).
    had_consumer: bool,
}

#[derive(Clone)]
struct Message {
    /// Position in the queue: requeued messages go back to it.
    seq: u64,
    body: Bytes,
    exchange: String,
    routing_key: String,
    redelivered: bool,
    /// Times returned to the queue.
    returns: u32,
    /// Set when the message was dead-lettered into this queue: where it died and why.
    death: Option<Death>,
}

impl Message {
    /// A message as published (never delivered, never dead).
    fn new(seq: u64, exchange: &str, routing_key: &str, body: Bytes) -> Self {
        Self {
            seq,
            body,
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            redelivered: false,
            returns: 0,
            death: None,
        }
    }

    fn as_dead_letter(&self, position: usize) -> DeadLetter {
        DeadLetter {
            position,
            id: content_id(&self.body),
            message_id: None,
            message_type: None,
            death: self.death.clone(),
            body: self.body.clone(),
        }
    }
}

struct Consumer {
    id: u64,
    prefetch: usize,
    in_flight: usize,
    tx: mpsc::UnboundedSender<Result<Delivery>>,
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

impl State {
    fn declare_exchange(&mut self, spec: &ExchangeSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "the default exchange cannot be declared".into(),
            ));
        }
        match self.exchanges.get(&spec.name) {
            Some(existing) if existing.kind != spec.kind => Err(BusError::DeclarationConflict {
                name: spec.name.clone(),
                reason: format!(
                    "exchange type {} differs from {}",
                    spec.kind.as_str(),
                    existing.kind.as_str()
                ),
            }),
            Some(_) => Ok(()),
            None => {
                self.exchanges.insert(
                    spec.name.clone(),
                    Exchange {
                        kind: spec.kind,
                        bindings: BTreeSet::new(),
                    },
                );
                Ok(())
            }
        }
    }

    fn declare_queue(&mut self, spec: &QueueSpec) -> Result<()> {
        check_name(&spec.name)?;
        if spec.name.is_empty() {
            return Err(BusError::InvalidArgument(
                "queue name must not be empty".into(),
            ));
        }
        for binding in &spec.bindings {
            self.check_binding(binding)?;
        }
        if let Some(existing) = self.queues.get(&spec.name) {
            if let Some(reason) = spec_conflict(&existing.spec, spec) {
                return Err(BusError::DeclarationConflict {
                    name: spec.name.clone(),
                    reason,
                });
            }
        } else {
            let mut stored = spec.clone();
            stored.bindings.clear();
            self.queues.insert(
                spec.name.clone(),
                Queue {
                    spec: stored,
                    ready: VecDeque::new(),
                    unacked: HashMap::new(),
                    consumers: Vec::new(),
                    cursor: 0,
                    next_seq: 0,
                    had_consumer: false,
                },
            );
        }
        for binding in &spec.bindings {
            self.bind(&spec.name, binding)?;
        }
        Ok(())
    }

    fn check_binding(&self, binding: &Binding) -> Result<()> {
        check_key(&binding.routing_key)?;
        if binding.exchange.is_empty() {
            return Err(BusError::InvalidArgument(
                "queues cannot be bound to the default exchange".into(),
            ));
        }
        if !self.exchanges.contains_key(&binding.exchange) {
            return Err(BusError::NotFound(format!(
                "exchange {:?}",
                binding.exchange
            )));
        }
        Ok(())
    }

    fn bind(&mut self, queue: &str, binding: &Binding) -> Result<()> {
        self.check_binding(binding)?;
        if !self.queues.contains_key(queue) {
            return Err(BusError::NotFound(format!("queue {queue:?}")));
        }
        let exchange = self
            .exchanges
            .get_mut(&binding.exchange)
            .expect("checked above");
        exchange
            .bindings
            .insert((binding.routing_key.clone(), queue.to_owned()));
        Ok(())
    }

    fn unbind(&mut self, queue: &str, binding: &Binding) -> Result<()> {
        if let Some(exchange) = self.exchanges.get_mut(&binding.exchange) {
            exchange
                .bindings
                .remove(&(binding.routing_key.clone(), queue.to_owned()));
        }
        Ok(())
    }

    fn delete_queue(&mut self, name: &str) {
        if self.queues.remove(name).is_some() {
            for exchange in self.exchanges.values_mut() {
                exchange.bindings.retain(|(_, q)| q != name);
            }
        }
        // Dropping the queue drops its consumers' senders: their subscriptions end with
        // `Closed`, and their unacked messages are gone with the queue.
    }

    /// Queues a message published to `exchange` with `routing_key` goes to.
    fn route(&self, exchange: &str, routing_key: &str) -> Result<Vec<String>> {
        if exchange.is_empty() {
            // The default exchange routes to the queue named by the routing key.
            return Ok(self
                .queues
                .contains_key(routing_key)
                .then(|| routing_key.to_owned())
                .into_iter()
                .collect());
        }
        let ex = self
            .exchanges
            .get(exchange)
            .ok_or_else(|| BusError::NotFound(format!("exchange {exchange:?}")))?;
        let mut queues: Vec<String> = match ex.kind {
            ExchangeKind::Fanout => ex.bindings.iter().map(|(_, q)| q.clone()).collect(),
            ExchangeKind::Direct => ex
                .bindings
                .range((routing_key.to_owned(), String::new())..)
                .take_while(|(k, _)| k == routing_key)
                .map(|(_, q)| q.clone())
                .collect(),
            ExchangeKind::Topic => ex
                .bindings
                .iter()
                .filter(|(pattern, _)| topic_matches(pattern, routing_key))
                .map(|(_, q)| q.clone())
                .collect(),
        };
        queues.sort();
        queues.dedup();
        Ok(queues)
    }

    fn publish(
        &mut self,
        shared: &Weak<Shared>,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
    ) -> Result<()> {
        self.publish_with_death(shared, exchange, routing_key, body, options, None)
    }

    /// [`publish`](Self::publish), recording `death` on every stored copy (dead-lettering).
    fn publish_with_death(
        &mut self,
        shared: &Weak<Shared>,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
        death: Option<Death>,
    ) -> Result<()> {
        check_key(routing_key)?;
        let targets = match self.route(exchange, routing_key) {
            // Unconfirmed: dropped, as RabbitMQ does (see "Best effort" on `Bus`).
            Err(BusError::NotFound(_)) if !options.confirmed() => return Ok(()),
            routed => routed?,
        };
        if targets.is_empty() && options.mandatory {
            return Err(BusError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            });
        }
        for name in targets {
            let queue = self
                .queues
                .get_mut(&name)
                .expect("routed to an existing queue");
            let seq = queue.next_seq;
            queue.next_seq += 1;
            let mut message = Message::new(seq, exchange, routing_key, body.clone());
            message.death.clone_from(&death);
            queue.ready.push_back(message);
            self.pump(shared, &name);
        }
        Ok(())
    }

    /// Hands ready messages of `queue` to consumers with free prefetch capacity.
    fn pump(&mut self, shared: &Weak<Shared>, queue_name: &str) {
        loop {
            let Some(queue) = self.queues.get_mut(queue_name) else {
                return;
            };
            if queue.ready.is_empty() || queue.consumers.is_empty() {
                return;
            }
            let index = if queue.spec.single_active_consumer {
                let active = &queue.consumers[0];
                if active.in_flight >= active.prefetch {
                    return;
                }
                0
            } else {
                let n = queue.consumers.len();
                let found = (0..n)
                    .map(|i| (queue.cursor + i) % n)
                    .find(|&i| queue.consumers[i].in_flight < queue.consumers[i].prefetch);
                let Some(index) = found else { return };
                queue.cursor = (index + 1) % n;
                index
            };
            let message = queue.ready.pop_front().expect("checked non-empty");
            let tag = self.next_tag;
            self.next_tag += 1;
            let queue = self.queues.get_mut(queue_name).expect("still there");
            let consumer = &mut queue.consumers[index];
            let delivery = Delivery::new(
                message.body.clone(),
                message.exchange.clone(),
                message.routing_key.clone(),
                message.redelivered,
                message.returns,
                Box::new(MemorySettler {
                    shared: shared.clone(),
                    queue: queue_name.to_owned(),
                    tag,
                }),
            );
            match consumer.tx.send(Ok(delivery)) {
                Ok(()) => {
                    consumer.in_flight += 1;
                    let id = consumer.id;
                    queue.unacked.insert(tag, (id, message));
                }
                Err(mpsc::error::SendError(returned)) => {
                    // The subscription is being dropped; its guard has not run yet. Forget the
                    // delivery (its settler finds no tag) and retire the consumer now.
                    let Ok(mut delivery) = returned else {
                        unreachable!("we sent Ok")
                    };
                    delivery.settler = None;
                    queue.ready.push_front(message);
                    let id = consumer.id;
                    self.remove_consumer(shared, queue_name, id);
                }
            }
        }
    }

    fn settle(
        &mut self,
        shared: &Weak<Shared>,
        queue_name: &str,
        tag: u64,
        settlement: Settlement,
    ) -> Result<()> {
        let Some(queue) = self.queues.get_mut(queue_name) else {
            return Err(BusError::Unavailable(format!(
                "queue {queue_name:?} was deleted"
            )));
        };
        let Some((consumer_id, message)) = queue.unacked.remove(&tag) else {
            return Err(BusError::Unavailable(
                "delivery is no longer held: its subscription was dropped and the message requeued"
                    .into(),
            ));
        };
        if let Some(consumer) = queue.consumers.iter_mut().find(|c| c.id == consumer_id) {
            consumer.in_flight -= 1;
        }
        match settlement {
            Settlement::Ack => {}
            // Like a RabbitMQ quorum queue (the strictest backend): a nacked message goes to
            // the back of the queue, behind younger messages.
            Settlement::Nack { requeue: true } => {
                self.requeue(shared, queue_name, message, Position::Back)
            }
            Settlement::Nack { requeue: false } => {
                self.dead_letter(shared, queue_name, message, DeathReason::Rejected);
            }
        }
        self.pump(shared, queue_name);
        Ok(())
    }

    /// Returns a message to the queue, or dead-letters it past the delivery limit.
    fn requeue(
        &mut self,
        shared: &Weak<Shared>,
        queue_name: &str,
        mut message: Message,
        position: Position,
    ) {
        let Some(queue) = self.queues.get_mut(queue_name) else {
            return;
        };
        message.returns += 1;
        message.redelivered = true;
        if queue
            .spec
            .effective_delivery_limit()
            .is_some_and(|limit| message.returns > limit)
        {
            self.dead_letter(shared, queue_name, message, DeathReason::DeliveryLimit);
            return;
        }
        match position {
            Position::Original => {
                let at = queue.ready.partition_point(|m| m.seq < message.seq);
                queue.ready.insert(at, message);
            }
            Position::Back => {
                message.seq = queue.next_seq;
                queue.next_seq += 1;
                queue.ready.push_back(message);
            }
        }
    }

    fn dead_letter(
        &mut self,
        shared: &Weak<Shared>,
        queue_name: &str,
        message: Message,
        reason: DeathReason,
    ) {
        let Some(dlx) = self
            .queues
            .get(queue_name)
            .and_then(|q| q.spec.dead_letter_exchange.clone())
        else {
            return;
        };
        // Like RabbitMQ's `x-death`: the count goes on when it dies again in the same queue for
        // the same reason.
        let count = match &message.death {
            Some(previous) if previous.queue == queue_name && previous.reason == reason => {
                previous.count + 1
            }
            _ => 1,
        };
        let death = Death {
            exchange: message.exchange.clone(),
            routing_key: message.routing_key.clone(),
            queue: queue_name.to_owned(),
            reason,
            count,
        };
        // Dead-lettering is best effort, like RabbitMQ's (at-most-once by default): a missing
        // exchange or no matching binding drops the message.
        let _ = self.publish_with_death(
            shared,
            &dlx,
            &message.routing_key,
            message.body,
            PublishOptions::best_effort(),
            Some(death),
        );
    }

    fn existing_queue(&self, name: &str) -> Result<&Queue> {
        check_name(name)?;
        self.queues
            .get(name)
            .ok_or_else(|| BusError::NotFound(format!("queue {name:?}")))
    }

    /// Replays under the lock: every step (publish, then remove the dead copy) is atomic here,
    /// so the at-least-once window of RabbitMQ does not exist.
    fn replay(
        &mut self,
        shared: &Weak<Shared>,
        queue_name: &str,
        options: &ReplayOptions,
    ) -> Result<ReplayReport> {
        // The messages present at the start; the walk examines no more (a replayed message
        // that dies again lands behind them).
        let snapshot: Vec<Message> = self
            .existing_queue(queue_name)?
            .ready
            .iter()
            .cloned()
            .collect();
        let mut walk = ReplayWalk::new(options, snapshot.len());
        for (index, message) in snapshot.into_iter().enumerate() {
            if !walk.wants_more() {
                break;
            }
            let letter = message.as_dead_letter(index + 1);
            let Step::Replay {
                exchange,
                routing_key,
            } = walk.next(&letter)
            else {
                continue;
            };
            match self.publish(
                shared,
                &exchange,
                &routing_key,
                message.body.clone(),
                PublishOptions::default(),
            ) {
                Ok(()) => {
                    if let Some(queue) = self.queues.get_mut(queue_name) {
                        queue.ready.retain(|m| m.seq != message.seq);
                    }
                    walk.replayed();
                }
                Err(error) if refusal_is_per_message(&error) => walk.refused(letter, error),
                Err(error) => {
                    walk.report.interrupted = Some(error);
                    break;
                }
            }
        }
        Ok(walk.report)
    }

    fn remove_consumer(&mut self, shared: &Weak<Shared>, queue_name: &str, consumer_id: u64) {
        let Some(queue) = self.queues.get_mut(queue_name) else {
            return;
        };
        let Some(index) = queue.consumers.iter().position(|c| c.id == consumer_id) else {
            return;
        };
        queue.consumers.remove(index);
        if queue.cursor > index {
            queue.cursor -= 1;
        }
        if queue.cursor >= queue.consumers.len() {
            queue.cursor = 0;
        }
        let mut returned: Vec<(u64, Message)> = Vec::new();
        queue.unacked.retain(|&tag, (owner, message)| {
            if *owner == consumer_id {
                returned.push((tag, message.clone()));
                false
            } else {
                true
            }
        });
        let auto_delete = queue.spec.kind == QueueKind::Exclusive
            && queue.had_consumer
            && queue.consumers.is_empty();
        if auto_delete {
            self.delete_queue(queue_name);
            return;
        }
        returned.sort_by_key(|(_, m)| m.seq);
        for (_, message) in returned {
            self.requeue(shared, queue_name, message, Position::Original);
        }
        self.pump(shared, queue_name);
    }
}

/// Where a returned message goes.
#[derive(Clone, Copy)]
enum Position {
    /// Back to where it was, ahead of younger messages (returns of a dropped subscription).
    Original,
    /// Behind every message (nack with requeue).
    Back,
}

/// Why `new` cannot redeclare `existing` (bindings are additive and never conflict).
fn spec_conflict(existing: &QueueSpec, new: &QueueSpec) -> Option<String> {
    let mut diffs = Vec::new();
    if existing.kind != new.kind {
        diffs.push("kind");
    }
    if existing.effective_queue_type() != new.effective_queue_type() {
        diffs.push("queue type");
    }
    if existing.single_active_consumer != new.single_active_consumer {
        diffs.push("single active consumer");
    }
    if existing.effective_delivery_limit() != new.effective_delivery_limit() {
        diffs.push("delivery limit");
    }
    if existing.dead_letter_exchange != new.dead_letter_exchange {
        diffs.push("dead-letter exchange");
    }
    (!diffs.is_empty()).then(|| format!("{} differ", diffs.join(", ")))
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
