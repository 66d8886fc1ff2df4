//! The per-shard consume loop: batches of the result deliveries that are ready at once.

use std::sync::Arc;

use futures::FutureExt;
use sb_common::bus::ConsumeOptions;
use sb_common::shutdown::Shutdown;

use super::ResultSink;
use crate::settle::pause;

/// Consumes results shard `shard` until shutdown, in batches of the deliveries that are
/// ready at once.
pub async fn run_shard(sink: Arc<ResultSink>, shard: u32, shutdown: Shutdown) {
    let queue = sink.deps.topology.results_queue(shard);
    let options = Arc::clone(&sink.options);
    let max_batch = options.sink_batch.max(1);
    'subscribe: loop {
        let subscribe = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            s = sink.deps.bus.subscribe(&queue, ConsumeOptions::prefetch(options.prefetch)) => s,
        };
        let mut subscription = match subscribe {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%error, queue = %queue.name, "cannot subscribe; retrying");
                if !pause(options.retry.max, &shutdown).await {
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
            let mut lost = false;
            let mut batch = match first {
                Ok(d) => vec![d],
                Err(error) => {
                    tracing::warn!(%error, queue = %queue.name, "subscription ended; resubscribing");
                    Vec::new()
                }
            };
            if batch.is_empty() {
                lost = true;
            }
            // Take whatever else is ready now, without waiting (`next` is cancel-safe).
            while !lost && batch.len() < max_batch {
                match subscription.next().now_or_never() {
                    Some(Ok(d)) => batch.push(d),
                    Some(Err(_)) => {
                        lost = true;
                    }
                    None => break,
                }
            }
            if !batch.is_empty() {
                sink.process_batch(batch, &queue.name, &shutdown).await;
            }
            if lost {
                if !pause(options.retry.initial, &shutdown).await {
                    return;
                }
                continue 'subscribe;
            }
        }
    }
}
