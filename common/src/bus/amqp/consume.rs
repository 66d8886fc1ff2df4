//! Consuming: one channel per subscription (its own `basic.qos`, so dropping it returns
//! exactly its unacked messages) and a task that forwards its deliveries and consumes again on
//! every new link; each channel's deliveries are settled by its [`ChannelSettler`].
//!
//! A delivery belongs to the channel it came on: once that channel or its connection is
//! gone, the broker has requeued the message, so settling it fails with
//! [`BusError::Unavailable`](crate::bus::BusError::Unavailable) and the message comes again
//! (`redelivered`).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use amqprs::channel::{BasicConsumeArguments, BasicQosArguments, ConsumerMessage};
use amqprs::{BasicProperties, FieldValue};
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::channel::Chan;
use super::failure::{AmqpError, Failure, classify};
use super::link::{CHANNEL_RETRY, Inner, Link};
use super::properties::{DELIVERY_COUNT, PUBLISHED_AT, epoch_ms, header, header_count};
use super::settle::ChannelSettler;
use crate::bus::{ConsumeOptions, Delivery, QueueKind, QueueSpec, Result, Subscription};

impl Inner {
    /// Subscribes to a queue (declaring it first); see
    /// [`Bus::subscribe`](crate::bus::Bus::subscribe).
    pub(super) async fn subscribe(
        self: &Arc<Self>,
        spec: &QueueSpec,
        options: ConsumeOptions,
    ) -> Result<Subscription> {
        self.declare_queue(spec).await?;
        let prefetch = options.prefetch.get();
        let tag = format!(
            "{}#{}",
            self.options.connection_name,
            self.next_consumer.fetch_add(1, Ordering::Relaxed)
        );
        let queue = spec.name.clone();
        let started = {
            let (queue, tag) = (&queue, &tag);
            self.retrying(|link| async move {
                start_consumer(&link, queue, prefetch, tag)
                    .await
                    .map(|(ch, consumer)| (ch, consumer, link))
            })
            .await?
        };
        if let Some((_, consumers)) = self.registry().queues.get_mut(&queue) {
            *consumers += 1;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        // Cancelled when the subscription is dropped or the bus closes.
        let cancel = self.shutdown.child_token();
        self.consumers.spawn(run_consumer(
            Arc::clone(self),
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
}

/// A delivery of the broker from `queue` as the bus hands it on; `None` for a message without
/// its method frame (amqprs always fills it in for a delivery).
fn convert(message: ConsumerMessage, queue: &str, settler: &ChannelSettler) -> Option<Delivery> {
    let deliver = message.deliver?;
    let properties = message.basic_properties.unwrap_or_default();
    observe_queue_lag(queue, &properties);
    let redelivered = deliver.redelivered();
    let delivery_count = header(&properties, &DELIVERY_COUNT)
        .and_then(header_count)
        .unwrap_or(u32::from(redelivered));
    Some(Delivery::new(
        Bytes::from(message.content.unwrap_or_default()),
        deliver.exchange().clone(),
        deliver.routing_key().clone(),
        redelivered,
        delivery_count,
        settler.delivered(deliver.delivery_tag()),
    ))
}

/// The deliveries of one consumer, in the order the broker sent them.
type Consumer = mpsc::UnboundedReceiver<ConsumerMessage>;

/// Opens a subscription channel with its prefetch and starts consuming.
async fn start_consumer(
    link: &Link,
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> std::result::Result<(Chan, Consumer), AmqpError> {
    let chan = Chan::open(&link.connection, None).await?;
    chan.call(
        chan.channel
            .basic_qos(BasicQosArguments::new(0, prefetch, false)),
    )
    .await?;
    let (_, consumer) = chan
        .call(
            chan.channel.basic_consume_rx(
                BasicConsumeArguments::new(queue, tag)
                    .manual_ack(true)
                    .finish(),
            ),
        )
        .await?;
    Ok((chan, consumer))
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
    mut current: Option<(Chan, Consumer, Arc<Link>)>,
) {
    // Channel failures in a row while starting the consumer, paced by `CHANNEL_RETRY`.
    let mut channel_failures = 0_u32;
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
                    Ok((channel, consumer)) => {
                        channel_failures = 0;
                        (channel, consumer, link)
                    }
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
                            if !link.connection.is_open() {
                                inner.report_broken(link.generation);
                            }
                            tokio::select! {
                                () = cancel.cancelled() => break,
                                () = tokio::time::sleep(CHANNEL_RETRY.delay(channel_failures)) => {}
                            }
                            channel_failures = channel_failures.saturating_add(1);
                            continue;
                        }
                    },
                }
            }
        };
        let settler = ChannelSettler::start(
            channel.clone(),
            queue.clone(),
            inner.options.operation_timeout,
        );
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    // What was settled goes out first; then closing the channel cancels the
                    // consumer and requeues its unsettled deliveries (and auto-deletes an
                    // exclusive queue left without consumer).
                    settler.finish(inner.options.operation_timeout).await;
                    let _ = tokio::time::timeout(
                        inner.options.operation_timeout,
                        channel.close(),
                    ).await;
                    finish(&inner, &queue);
                    return;
                }
                item = consumer.recv() => match item {
                    Some(message) => {
                        // A send error means the subscription is being dropped: `cancel` follows.
                        if let Some(delivery) = convert(message, &queue, &settler) {
                            let _ = tx.send(Ok(delivery));
                        }
                    }
                    None => break,
                },
            }
        }
        // The stream ended: connection lost, channel closed, bus closed, or the broker
        // cancelled the consumer because the queue was deleted.
        if inner.is_closed() || cancel.is_cancelled() {
            break;
        }
        if channel.consumer_cancelled() {
            tracing::info!(queue, "the broker cancelled the consumer (queue deleted)");
            break;
        }
        if !link.connection.is_open() {
            inner.report_broken(link.generation);
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

/// Records the time from publish to consume of one delivery (clock skew between hosts can
/// make it negative: clamped to zero).
fn observe_queue_lag(queue: &str, properties: &BasicProperties) {
    let published = match header(properties, &PUBLISHED_AT) {
        Some(FieldValue::l(ms)) => Some(*ms),
        _ => None,
    };
    if let Some(ms) = published {
        let lag = (epoch_ms() - ms).max(0) as f64 / 1000.0;
        crate::telemetry::Metrics::global().observe(
            crate::telemetry::names::QUEUE_LAG_SECONDS,
            &[("queue", queue)],
            lag,
        );
    }
}
