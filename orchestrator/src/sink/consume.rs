//! The per-shard consume loop: batches of the result deliveries that are ready at once.

use std::sync::Arc;

use sb_common::bus::consumer::ConsumeLoop;
use sb_common::shutdown::Shutdown;

use super::ResultSink;

/// Consumes results shard `shard` until shutdown, in batches of the deliveries that are
/// ready at once (at most `sink_batch`).
pub async fn run_shard(sink: Arc<ResultSink>, shard: u32, shutdown: Shutdown) {
    let queue = sink.deps.topology.results_queue(shard);
    let options = &sink.options;
    let consumer = ConsumeLoop {
        bus: sink.deps.bus.as_ref(),
        queue: &queue,
        prefetch: options.prefetch,
        max_batch: options.sink_batch,
        retry: options.retry,
    };
    consumer
        .run(None, shutdown.as_ref(), |batch| {
            sink.process_batch(batch, &queue.name, &shutdown)
        })
        .await;
}
