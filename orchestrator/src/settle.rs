//! The parts every consumer loop of the orchestrator shares: [`consume`] keeps a queue
//! subscribed and hands its deliveries over in batches of what is ready at once, [`settle`]
//! acks, requeues or dead-letters a delivery from the outcome of handling it, and [`pause`]
//! waits out a backoff unless shutdown begins.
//!
//! The events and results loops share them, so resubscribing and the disposition of a
//! failure are decided in exactly one place (the latter from its error code,
//! [`ErrorCode::disposition`]); they live beside the loops rather than in the service
//! (`service`), which only spawns and supervises them.
//!
//! [`ErrorCode::disposition`]: sb_protocol::error::ErrorCode::disposition

use std::future::Future;
use std::time::Duration;

use futures::FutureExt as _;
use sb_common::bus::{Bus, ConsumeOptions, Delivery, QueueSpec};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::error::{Disposition, HasErrorCode};

use crate::deps::OrchestratorOptions;
use crate::error::Result;

/// Settles a delivery from the outcome of handling it, by the error code's disposition
/// (the project's one mapping): `Ack` removes it, `Retry` requeues it after a backoff
/// (cut short by shutdown), `DeadLetter` rejects it to the dead-letter exchange.
pub(crate) async fn settle(
    delivery: Delivery,
    outcome: &Result<()>,
    queue: &str,
    options: &OrchestratorOptions,
    shutdown: &Shutdown,
) {
    let disposition = match outcome {
        Ok(()) => Disposition::Ack,
        Err(error) => {
            let disposition = error.code().disposition();
            match disposition {
                Disposition::Ack => {
                    tracing::info!(%error, queue, "message handled with a final error")
                }
                Disposition::Retry => {
                    tracing::warn!(%error, queue, attempts = delivery.delivery_count, "message will be retried")
                }
                Disposition::DeadLetter => tracing::error!(%error, queue, "message dead-lettered"),
            }
            disposition
        }
    };
    let (label, settled) = match disposition {
        Disposition::Ack => ("ack", delivery.ack().await),
        Disposition::Retry => {
            let delay = options.retry_delay(delivery.delivery_count);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
            ("retry", delivery.nack(true).await)
        }
        Disposition::DeadLetter => ("dead_letter", delivery.nack(false).await),
    };
    if let Err(error) = settled {
        // The broker will redeliver it; every handler is idempotent.
        tracing::warn!(%error, queue, "could not settle a delivery");
    }
    Metrics::global().inc(
        names::BUS_CONSUMED_TOTAL,
        &[("queue", queue), ("disposition", label)],
    );
}

/// Waits `delay` unless shutdown begins first; `false` on shutdown.
pub(crate) async fn pause(delay: Duration, shutdown: &Shutdown) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// Consumes `queue` until shutdown, handing `handle` the deliveries in order, each time as
/// many as are ready at once (at least one, at most `max_batch`; `1` hands them one by one)
/// and awaiting it before taking more. A subscription that cannot be made is retried after
/// `retry.max`; one that ends is made again after `retry.initial`, once the deliveries
/// already taken are handled (the broker redelivers the unacked rest).
pub(crate) async fn consume<F, Fut>(
    bus: &dyn Bus,
    queue: &QueueSpec,
    max_batch: usize,
    options: &OrchestratorOptions,
    shutdown: &Shutdown,
    mut handle: F,
) where
    F: FnMut(Vec<Delivery>) -> Fut,
    Fut: Future<Output = ()>,
{
    let max_batch = max_batch.max(1);
    'subscribe: loop {
        let subscribe = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            s = bus.subscribe(queue, ConsumeOptions::prefetch(options.prefetch)) => s,
        };
        let mut subscription = match subscribe {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%error, queue = %queue.name, "cannot subscribe; retrying");
                if !pause(options.retry.max, shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        };
        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                d = subscription.next() => d,
            };
            let mut batch = Vec::new();
            let mut lost = match first {
                Ok(d) => {
                    batch.push(d);
                    false
                }
                Err(error) => {
                    tracing::warn!(%error, queue = %queue.name, "subscription ended; resubscribing");
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
                if !pause(options.retry.initial, shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        }
    }
}
