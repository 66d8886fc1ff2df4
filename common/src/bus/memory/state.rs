//! The broker itself: exchanges, queues, messages and consumers, changed only synchronously
//! under the bus's one lock.
//!
//! Every operation of [`MemoryBus`](super::MemoryBus) locks [`State`] and calls one method
//! here, which applies the whole change (routing, delivery to consumers within their
//! prefetch, returns, dead-lettering) before the lock is released; nothing here awaits.
//! Deliveries leave through each consumer's unbounded channel, whose length prefetch bounds.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Weak;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::{MemorySettler, Shared};
use crate::bus::dead_letters::{
    DeadLetter, Death, DeathReason, ReplayOptions, ReplayReport, ReplayWalk, Step, content_id,
    refusal_is_per_message,
};
use crate::bus::{
    Binding, BusError, Delivery, ExchangeKind, ExchangeSpec, PublishOptions, QueueKind, QueueSpec,
    QueueUse, Result, Settlement, check_key, check_name, in_use, topic_matches,
};

#[derive(Default)]
pub(super) struct State {
    pub(super) closed: bool,
    pub(super) exchanges: HashMap<String, Exchange>,
    pub(super) queues: HashMap<String, Queue>,
    /// Delivery tags and consumer ids are global so a tag can never be confused with one of a
    /// deleted-and-redeclared queue of the same name.
    pub(super) next_tag: u64,
    pub(super) next_consumer: u64,
}

pub(super) struct Exchange {
    pub(super) kind: ExchangeKind,
    /// (binding key, queue name).
    bindings: BTreeSet<(String, String)>,
    /// A topic exchange's bindings by a literal word every key they match has at a known place
    /// ([`Anchor`]): a publish matches word by word only the bindings filed under its key's
    /// words at the places in use, and those in `unanchored`. A gateway binds `*.*.<run id>`
    /// per watched run and `<workspace>.<conversation>.*` per watched conversation, so without
    /// this every publish would match every watched run's and conversation's binding, under
    /// the bus's lock.
    /// Keyed by place, then word: the places in use are the outer keys (a place whose last
    /// binding goes is dropped), and a routing key's word is looked up without a copy.
    anchored: BTreeMap<Anchor, HashMap<String, BTreeSet<(String, String)>>>,
    /// A topic exchange's bindings without an anchor (`#`, `#.*`, ``).
    unanchored: BTreeSet<(String, String)>,
}

/// Where a topic binding key has a literal word every routing key it matches has too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Anchor {
    /// The last word.
    Last,
    /// The word at this index, counted from the first (no `#` before it).
    FromStart(usize),
}

impl Anchor {
    /// Where to file a binding with `key`, and its word there: the last word when it is
    /// literal, else the last literal word before the first `#`. `None`: every word that
    /// could anchor it is a wildcard.
    fn of(key: &str) -> Option<(Self, &str)> {
        if key.is_empty() {
            return None;
        }
        let literal = |word: &str| !matches!(word, "*" | "#");
        let words: Vec<&str> = key.split('.').collect();
        if let Some(last) = words.last().copied().filter(|word| literal(word)) {
            return Some((Self::Last, last));
        }
        words
            .into_iter()
            .take_while(|word| *word != "#")
            .enumerate()
            .filter(|(_, word)| literal(word))
            .last()
            .map(|(at, word)| (Self::FromStart(at), word))
    }

    /// The word of `routing_key` (split into `words`) at this place, if it has one.
    fn word<'k>(self, words: &[&'k str]) -> Option<&'k str> {
        match self {
            Self::Last => words.last().copied(),
            Self::FromStart(at) => words.get(at).copied(),
        }
    }
}

impl Exchange {
    fn new(kind: ExchangeKind) -> Self {
        Self {
            kind,
            bindings: BTreeSet::new(),
            anchored: BTreeMap::new(),
            unanchored: BTreeSet::new(),
        }
    }

    fn insert(&mut self, key: &str, queue: &str) {
        let binding = (key.to_owned(), queue.to_owned());
        if !self.bindings.insert(binding.clone()) || self.kind != ExchangeKind::Topic {
            return;
        }
        match Anchor::of(key) {
            Some((anchor, word)) => {
                self.anchored
                    .entry(anchor)
                    .or_default()
                    .entry(word.to_owned())
                    .or_default()
                    .insert(binding);
            }
            None => {
                self.unanchored.insert(binding);
            }
        }
    }

    fn remove(&mut self, key: &str, queue: &str) {
        let binding = (key.to_owned(), queue.to_owned());
        if !self.bindings.remove(&binding) || self.kind != ExchangeKind::Topic {
            return;
        }
        match Anchor::of(key) {
            Some((anchor, word)) => {
                let Some(words) = self.anchored.get_mut(&anchor) else {
                    return;
                };
                if let Some(bucket) = words.get_mut(word) {
                    bucket.remove(&binding);
                    if bucket.is_empty() {
                        words.remove(word);
                    }
                }
                if words.is_empty() {
                    self.anchored.remove(&anchor);
                }
            }
            None => {
                self.unanchored.remove(&binding);
            }
        }
    }

    fn remove_queue(&mut self, queue: &str) {
        let keys: Vec<String> = self
            .bindings
            .iter()
            .filter(|(_, q)| q == queue)
            .map(|(key, _)| key.clone())
            .collect();
        for key in keys {
            self.remove(&key, queue);
        }
    }

    /// The queues of the bindings that route `routing_key` (a queue bound twice is listed
    /// twice).
    fn route(&self, routing_key: &str) -> Vec<String> {
        let bound = |(_, q): &(String, String)| q.clone();
        match self.kind {
            ExchangeKind::Fanout => self.bindings.iter().map(bound).collect(),
            ExchangeKind::Direct => self
                .bindings
                .range((routing_key.to_owned(), String::new())..)
                .take_while(|(k, _)| k == routing_key)
                .map(bound)
                .collect(),
            ExchangeKind::Topic => {
                let words: Vec<&str> = if routing_key.is_empty() {
                    Vec::new()
                } else {
                    routing_key.split('.').collect()
                };
                self.anchored
                    .iter()
                    .filter_map(|(anchor, filed)| filed.get(anchor.word(&words)?))
                    .flatten()
                    .chain(&self.unanchored)
                    .filter(|(pattern, _)| topic_matches(pattern, routing_key))
                    .map(bound)
                    .collect()
            }
        }
    }
}

pub(super) struct Queue {
    pub(super) spec: QueueSpec,
    /// Ready messages in queue order (ascending `seq`).
    pub(super) ready: VecDeque<Message>,
    /// Delivered, not yet settled, by delivery tag.
    pub(super) unacked: HashMap<u64, (u64, Message)>,
    /// Registration order; on a single-active-consumer queue the first one is the active one.
    pub(super) consumers: Vec<Consumer>,
    /// Round-robin cursor over `consumers`.
    pub(super) cursor: usize,
    pub(super) next_seq: u64,
    /// Auto-delete only triggers once a queue has had a consumer (as in RabbitMQ).
    pub(super) had_consumer: bool,
}

#[derive(Clone)]
pub(super) struct Message {
    /// Position in the queue: requeued messages go back to it.
    pub(super) seq: u64,
    pub(super) body: Bytes,
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) redelivered: bool,
    /// Times returned to the queue.
    pub(super) returns: u32,
    /// Set when the message was dead-lettered into this queue: where it died and why.
    pub(super) death: Option<Death>,
}

impl Message {
    /// A message as published (never delivered, never dead).
    pub(super) fn new(seq: u64, exchange: &str, routing_key: &str, body: Bytes) -> Self {
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

    pub(super) fn as_dead_letter(&self, position: usize) -> DeadLetter {
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

pub(super) struct Consumer {
    pub(super) id: u64,
    pub(super) prefetch: usize,
    pub(super) in_flight: usize,
    pub(super) tx: mpsc::UnboundedSender<Result<Delivery>>,
}

impl State {
    pub(super) fn declare_exchange(&mut self, spec: &ExchangeSpec) -> Result<()> {
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
                self.exchanges
                    .insert(spec.name.clone(), Exchange::new(spec.kind));
                Ok(())
            }
        }
    }

    pub(super) fn declare_queue(&mut self, spec: &QueueSpec) -> Result<()> {
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

    pub(super) fn check_binding(&self, binding: &Binding) -> Result<()> {
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

    pub(super) fn bind(&mut self, queue: &str, binding: &Binding) -> Result<()> {
        self.check_binding(binding)?;
        if !self.queues.contains_key(queue) {
            return Err(BusError::NotFound(format!("queue {queue:?}")));
        }
        let exchange = self
            .exchanges
            .get_mut(&binding.exchange)
            .expect("checked above");
        exchange.insert(&binding.routing_key, queue);
        Ok(())
    }

    pub(super) fn unbind(&mut self, queue: &str, binding: &Binding) -> Result<()> {
        if let Some(exchange) = self.exchanges.get_mut(&binding.exchange) {
            exchange.remove(&binding.routing_key, queue);
        }
        Ok(())
    }

    pub(super) fn delete_queue(&mut self, name: &str) {
        if self.queues.remove(name).is_some() {
            for exchange in self.exchanges.values_mut() {
                exchange.remove_queue(name);
            }
        }
        // Dropping the queue drops its consumers' senders: their subscriptions end with
        // `Closed`, and their unacked messages are gone with the queue.
    }

    /// What is in `name`: its messages, ready or delivered (an unacked message would be lost
    /// with the queue), and its consumers.
    pub(super) fn inspect_queue(&self, name: &str) -> Option<QueueUse> {
        let queue = self.queues.get(name)?;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Some(QueueUse {
            messages: count(queue.ready.len() + queue.unacked.len()),
            consumers: count(queue.consumers.len()),
        })
    }

    /// Deletes `name` unless it is in use ([`Self::inspect_queue`]).
    pub(super) fn retire_queue(&mut self, name: &str) -> Result<()> {
        match self.inspect_queue(name) {
            Some(used) if !used.is_idle() => Err(in_use(name, used)),
            _ => {
                self.delete_queue(name);
                Ok(())
            }
        }
    }

    /// Queues a message published to `exchange` with `routing_key` goes to.
    pub(super) fn route(&self, exchange: &str, routing_key: &str) -> Result<Vec<String>> {
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
        let mut queues = ex.route(routing_key);
        queues.sort();
        queues.dedup();
        Ok(queues)
    }

    pub(super) fn publish(
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
    pub(super) fn publish_with_death(
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
    pub(super) fn pump(&mut self, shared: &Weak<Shared>, queue_name: &str) {
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

    pub(super) fn settle(
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
    pub(super) fn requeue(
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

    pub(super) fn dead_letter(
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

    pub(super) fn existing_queue(&self, name: &str) -> Result<&Queue> {
        check_name(name)?;
        self.queues
            .get(name)
            .ok_or_else(|| BusError::NotFound(format!("queue {name:?}")))
    }

    /// Replays under the lock: every step (publish, then remove the dead copy) is atomic here,
    /// so the at-least-once window of RabbitMQ does not exist.
    pub(super) fn replay(
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

    pub(super) fn remove_consumer(
        &mut self,
        shared: &Weak<Shared>,
        queue_name: &str,
        consumer_id: u64,
    ) {
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
pub(super) enum Position {
    /// Back to where it was, ahead of younger messages (returns of a dropped subscription).
    Original,
    /// Behind every message (nack with requeue).
    Back,
}

/// Why `new` cannot redeclare `existing` (bindings are additive and never conflict).
pub(super) fn spec_conflict(existing: &QueueSpec, new: &QueueSpec) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(exchange: &Exchange, key: &str) -> Vec<String> {
        let mut queues = exchange.route(key);
        queues.sort();
        queues
    }

    /// The index finds what matching every binding would, and forgets what is unbound or
    /// deleted.
    #[test]
    fn a_topic_exchange_routes_through_its_index_as_through_every_binding() {
        let mut ex = Exchange::new(ExchangeKind::Topic);
        let bindings = [
            ("*.*.run1", "gw1"),
            ("*.*.run2", "gw2"),
            ("ws.conv.*", "gw3"),
            ("ws.other.*", "gw4"),
            ("#.run1", "any-run1"),
            ("ws.#", "ws"),
            ("*.conv.#", "conv"),
            ("ws.conv.run1", "exact"),
            ("#", "all"),
        ];
        for (key, queue) in bindings {
            ex.insert(key, queue);
        }
        let keys = [
            "ws.conv.run1",
            "ws.conv.run2",
            "ws.other.run2",
            "x.y.run1",
            "run1",
            "ws",
            "x.conv",
            "other",
            "",
        ];
        for key in keys {
            let mut everything: Vec<String> = bindings
                .iter()
                .filter(|(pattern, _)| topic_matches(pattern, key))
                .map(|(_, q)| (*q).to_owned())
                .collect();
            everything.sort();
            assert_eq!(routed(&ex, key), everything, "{key:?}");
        }

        ex.remove("*.*.run1", "gw1");
        ex.remove("*.*.run1", "gw1");
        ex.remove_queue("exact");
        ex.remove_queue("all");
        ex.remove_queue("conv");
        assert_eq!(routed(&ex, "ws.conv.run1"), ["any-run1", "gw3", "ws"]);
        ex.remove("*.*.run2", "gw2");
        assert!(!ex.anchored[&Anchor::Last].contains_key("run2"));
        ex.remove("#.run1", "any-run1");
        assert_eq!(
            ex.anchored.get(&Anchor::Last),
            None,
            "no binding is filed by its last word"
        );
        let filed = |anchor| {
            ex.anchored
                .get(&anchor)
                .map_or(0, |w| w.values().map(BTreeSet::len).sum())
        };
        assert_eq!(filed(Anchor::FromStart(1)), 2);
    }

    #[test]
    fn a_binding_is_filed_by_a_word_every_key_it_matches_has() {
        assert_eq!(Anchor::of("*.*.run1"), Some((Anchor::Last, "run1")));
        assert_eq!(Anchor::of("#.c"), Some((Anchor::Last, "c")));
        assert_eq!(Anchor::of("a"), Some((Anchor::Last, "a")));
        assert_eq!(
            Anchor::of("ws.conv.*"),
            Some((Anchor::FromStart(1), "conv"))
        );
        assert_eq!(Anchor::of("*.x.#.*"), Some((Anchor::FromStart(1), "x")));
        assert_eq!(Anchor::of("a.#"), Some((Anchor::FromStart(0), "a")));
        assert_eq!(Anchor::of("#.a.*"), None);
        assert_eq!(Anchor::of("*.*"), None);
        assert_eq!(Anchor::of(""), None);
    }
}
