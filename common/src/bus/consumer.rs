//! The one consume-and-settle loop every consumer of the bus runs: the orchestrator's events
//! and results loops, the worker's job and control loops, the gateway's live deliveries.
//!
//! [`ConsumeLoop::run`] keeps a queue subscribed and hands its deliveries over in batches of
//! what is ready at once; [`settle`] acks, requeues (after a backoff) or dead-letters a
//! delivery; [`settle_outcome`] does so from the outcome of handling it, by its error code's
//! disposition ([`ErrorCode::disposition`], the project's one mapping). Resubscribing, the
//! requeue backoff and the disposition of a failure are therefore decided here only; the
//! consumers decide what a delivery means.
//!
//! [`ErrorCode::disposition`]: sb_protocol::error::ErrorCode::disposition

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use futures::FutureExt as _;
use sb_protocol::error::{Disposition, HasErrorCode};
use tokio_util::sync::CancellationToken;

use super::{Bus, ConsumeOptions, Delivery, QueueSpec, Settlement, Subscription};
use crate::retry::RetryPolicy;
use crate::telemetry::{Metrics, names};

impl From<Disposition> for Settlement {
    fn from(disposition: Disposition) -> Self {
        match disposition {
            Disposition::Ack => Self::Ack,
            Disposition::Retry => Self::Nack { requeue: true },
            Disposition::DeadLetter => Self::Nack { requeue: false },
        }
    }
}

/// How [`ConsumeLoop::run_subscription`] ended.
#[derive(Debug)]
pub enum Ended {
    /// `stop` came: the subscription, still live.
    Stopped(Subscription),
    /// The subscription ended (the bus closed, the queue was deleted); the deliveries taken
    /// before were handled.
    Lost,
}

/// A consumer of one queue: where it reads, how much it takes at once, how it backs off.
#[derive(Clone, Copy)]
pub struct ConsumeLoop<'a> {
    /// The bus.
    pub bus: &'a dyn Bus,
    /// The queue (declared again by every subscription).
    pub queue: &'a QueueSpec,
    /// Deliveries the broker may hand this consumer before it settles them.
    pub prefetch: u16,
    /// Most deliveries handed over at once (`1` hands them one by one).
    pub max_batch: usize,
    /// A subscription that ended is made again after `retry.initial`; one that cannot be
    /// made is tried again after `retry.max`.
    pub retry: RetryPolicy,
}

impl ConsumeLoop<'_> {
    /// Consumes the queue until `stop`, handing `handle` the deliveries in order, each time
    /// as many as are ready at once (at least one, at most `max_batch`), and awaiting it
    /// before taking more: a handler that waits (for a free slot, say) holds the loop, and
    /// the prefetch bounds what the broker buffers meanwhile.
    ///
    /// Starts from `subscription` when given (a consumer that subscribes at startup, to fail
    /// fast), else subscribes. A subscription that ends is made again after `retry.initial`,
    /// once the deliveries already taken are handled (the broker redelivers the unacked
    /// rest). Returns the subscription it held at `stop`, so that a consumer whose
    /// deliveries are still being handled elsewhere can keep them settleable until it drops
    /// it.
    pub async fn run<F, Fut>(
        &self,
        mut subscription: Option<Subscription>,
        stop: &CancellationToken,
        mut handle: F,
    ) -> Option<Subscription>
    where
        F: FnMut(Vec<Delivery>) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            let current = match subscription.take() {
                Some(current) => current,
                None => self.subscribe(stop).await?,
            };
            match self.run_subscription(current, stop, &mut handle).await {
                Ended::Stopped(held) => return Some(held),
                Ended::Lost => {
                    if !pause(self.retry.initial, stop).await {
                        return None;
                    }
                }
            }
        }
    }

    /// [`Self::run`] over one subscription, until `stop` or until it ends: for a consumer
    /// that must do something of its own when its subscription is lost (an exclusive queue
    /// whose bindings went with it) before it subscribes again, or instead.
    pub async fn run_subscription<F, Fut>(
        &self,
        mut subscription: Subscription,
        stop: &CancellationToken,
        handle: &mut F,
    ) -> Ended
    where
        F: FnMut(Vec<Delivery>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let max_batch = self.max_batch.max(1);
        loop {
            let first = tokio::select! {
                biased;
                () = stop.cancelled() => return Ended::Stopped(subscription),
                d = subscription.next() => d,
            };
            let mut batch = Vec::new();
            let mut lost = match first {
                Ok(d) => {
                    batch.push(d);
                    false
                }
                Err(error) => {
                    tracing::warn!(%error, queue = %self.queue.name, "subscription ended");
                    true
                }
            };
            // Take whatever else is ready now, without waiting (`next` is cancel-safe).
            while !lost && batch.len() < max_batch {
                match subscription.next().now_or_never() {
                    Some(Ok(d)) => batch.push(d),
                    Some(Err(_)) => lost = true,
                    None => break,
                }
            }
            if !batch.is_empty() {
                handle(batch).await;
            }
            if lost {
                return Ended::Lost;
            }
        }
    }

    /// Subscribes, retrying every `retry.max` until it works; `None` on `stop`.
    async fn subscribe(&self, stop: &CancellationToken) -> Option<Subscription> {
        loop {
            let subscribed = tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                s = self.bus.subscribe(self.queue, ConsumeOptions::prefetch(self.prefetch)) => s,
            };
            match subscribed {
                Ok(subscription) => return Some(subscription),
                Err(error) => {
                    tracing::warn!(%error, queue = %self.queue.name, "cannot subscribe; retrying");
                    if !pause(self.retry.max, stop).await {
                        return None;
                    }
                }
            }
        }
    }
}

/// Settles a delivery from the outcome of handling it, by the error code's disposition:
/// `Ack` removes it, `Retry` requeues it after a backoff, `DeadLetter` rejects it to the
/// dead-letter exchange (see [`settle`]). Logs a failure at the level its disposition
/// deserves.
pub async fn settle_outcome<E: HasErrorCode + Display>(
    delivery: Delivery,
    outcome: &Result<(), E>,
    queue: &str,
    retry: &RetryPolicy,
    stop: &CancellationToken,
) {
    let disposition = match outcome {
        Ok(()) => Disposition::Ack,
        Err(error) => {
            let disposition = error.code().disposition();
            match disposition {
                Disposition::Ack => {
                    tracing::info!(%error, queue, "message handled with a final error");
                }
                Disposition::Retry => {
                    tracing::warn!(%error, queue, attempts = delivery.delivery_count, "message will be retried");
                }
                Disposition::DeadLetter => tracing::error!(%error, queue, "message dead-lettered"),
            }
            disposition
        }
    };
    settle(delivery, disposition.into(), queue, retry, stop).await;
}

/// Settles a delivery: an ack, a rejection (to the dead-letter exchange, if the queue has
/// one), or a requeue after `retry.delay(delivery_count)` — cut short by `stop`, so a
/// draining consumer hands its deliveries back at once. A settle that fails is logged: the
/// broker redelivers the message, and every handler is idempotent. Counted in
/// `sb_bus_consumed_total` by queue and disposition.
pub async fn settle(
    mut delivery: Delivery,
    settlement: Settlement,
    queue: &str,
    retry: &RetryPolicy,
    stop: &CancellationToken,
) {
    let label = match settlement {
        Settlement::Ack => "ack",
        Settlement::Nack { requeue: true } => {
            pause(retry.delay(delivery.delivery_count), stop).await;
            "retry"
        }
        Settlement::Nack { requeue: false } => "dead_letter",
    };
    if let Err(error) = delivery.settle(settlement).await {
        tracing::warn!(%error, queue, "could not settle a delivery");
    }
    Metrics::global().inc(
        names::BUS_CONSUMED_TOTAL,
        &[("queue", queue), ("disposition", label)],
    );
}

/// Waits `delay` unless `stop` comes first; `false` on `stop`.
pub async fn pause(delay: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::bus::memory::MemoryBus;
    use crate::bus::{ExchangeKind, ExchangeSpec, PublishOptions};

    const RETRY: RetryPolicy =
        RetryPolicy::new(Duration::from_millis(10), Duration::from_millis(20));

    async fn bus_with_queue(name: &str) -> (Arc<MemoryBus>, QueueSpec) {
        let bus = Arc::new(MemoryBus::new());
        bus.declare_exchange(&ExchangeSpec::new("x", ExchangeKind::Direct))
            .await
            .unwrap();
        let queue = QueueSpec::durable(name).bind("x", name);
        bus.declare_queue(&queue).await.unwrap();
        (bus, queue)
    }

    async fn publish(bus: &MemoryBus, key: &str, body: &'static str) {
        bus.publish(
            "x",
            key,
            Bytes::from_static(body.as_bytes()),
            PublishOptions::default(),
        )
        .await
        .unwrap();
    }

    #[test]
    fn dispositions_settle_as_the_one_mapping_says() {
        assert_eq!(Settlement::from(Disposition::Ack), Settlement::Ack);
        assert_eq!(
            Settlement::from(Disposition::Retry),
            Settlement::Nack { requeue: true }
        );
        assert_eq!(
            Settlement::from(Disposition::DeadLetter),
            Settlement::Nack { requeue: false }
        );
    }

    /// What is ready at once is handed over together (up to `max_batch`), in order; a
    /// requeued delivery comes again; `stop` ends the loop with its subscription.
    #[tokio::test]
    async fn deliveries_come_in_ready_batches_in_order_and_requeued_ones_come_again() {
        let (bus, queue) = bus_with_queue("consumer_batches").await;
        for body in ["a", "b", "c"] {
            publish(&bus, "consumer_batches", body).await;
        }
        let stop = CancellationToken::new();
        let seen = Arc::new(std::sync::Mutex::new(Vec::<Vec<String>>::new()));
        let consumer = ConsumeLoop {
            bus: bus.as_ref(),
            queue: &queue,
            prefetch: 10,
            max_batch: 2,
            retry: RETRY,
        };
        let run = {
            let (seen, stop) = (seen.clone(), stop.clone());
            async move {
                consumer
                    .run(None, &stop, |batch| {
                        let (seen, stop) = (seen.clone(), stop.clone());
                        async move {
                            let mut bodies = Vec::new();
                            for delivery in batch {
                                let body = String::from_utf8(delivery.body.to_vec()).unwrap();
                                // `b` fails once, transiently: requeued, it comes again.
                                let again = delivery.redelivered;
                                let settlement = if body == "b" && !again {
                                    Settlement::Nack { requeue: true }
                                } else {
                                    Settlement::Ack
                                };
                                bodies.push(format!("{body}{}", if again { "'" } else { "" }));
                                settle(delivery, settlement, "consumer_batches", &RETRY, &stop)
                                    .await;
                            }
                            let mut seen = seen.lock().unwrap();
                            seen.push(bodies);
                            if seen.iter().flatten().any(|b| b == "b'") {
                                stop.cancel();
                            }
                        }
                    })
                    .await
            }
        };
        let held = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the loop ends on stop");
        assert!(held.is_some(), "the subscription held at stop is returned");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen[0], vec!["a", "b"], "what was ready, up to max_batch");
        assert_eq!(
            seen.concat(),
            vec!["a", "b", "c", "b'"],
            "in order, the requeued one again"
        );
    }

    /// A subscription that ends is made again, and consuming goes on.
    #[tokio::test]
    async fn an_ended_subscription_is_made_again() {
        let (bus, queue) = bus_with_queue("consumer_resubscribe").await;
        let stop = CancellationToken::new();
        let (tx, rx) =
            tokio::sync::mpsc::unbounded_channel::<Result<Delivery, crate::bus::BusError>>();
        // A first subscription that ends at once.
        let ended = Subscription::new("consumer_resubscribe".to_owned(), rx, Box::new(()));
        drop(tx);
        publish(&bus, "consumer_resubscribe", "after").await;
        let consumer = ConsumeLoop {
            bus: bus.as_ref(),
            queue: &queue,
            prefetch: 1,
            max_batch: 1,
            retry: RETRY,
        };
        let got = Arc::new(std::sync::Mutex::new(Vec::new()));
        let run = consumer.run(Some(ended), &stop, |batch| {
            let (got, stop) = (got.clone(), stop.clone());
            async move {
                for delivery in batch {
                    got.lock().unwrap().push(delivery.body.clone());
                    settle(delivery, Settlement::Ack, "q", &RETRY, &stop).await;
                }
                stop.cancel();
            }
        });
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the loop ends on stop");
        assert_eq!(
            got.lock().unwrap().as_slice(),
            [Bytes::from_static(b"after")]
        );
    }
}
