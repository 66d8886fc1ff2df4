//! The per-shard consume loop: the deliveries ready at once, routed side by side by lane
//! (each lane in order) and settled one by one.
//!
//! ```text
//!  batch:  a1 b1 a2 c1 ·x· a3        (a, b, c: lanes; x: a message without a lane)
//!  segment 1:  a: a1 → a2            segment 2: x       segment 3: a: a3
//!              b: b1                 (alone)
//!              c: c1
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use sb_common::bus::Delivery;
use sb_common::bus::consumer::{ConsumeLoop, pause, settle_outcome};
use sb_common::shutdown::Shutdown;
use sb_protocol::messages::{self, DecodeError, EventMessage};
use tracing::Instrument;

use super::{EventRouter, RouteOutcome};
use crate::error::{OrchestratorError, Result};

impl EventRouter {
    /// Routes a consumed event message. While another consumer holds the event's route lock,
    /// waits here (polling, up to `route_lock_ttl`) instead of requeueing at once: every
    /// requeue counts against the queue's delivery limit, and the lock of a consumer that
    /// died mid-route outlives a few quick retries — the event would be dead-lettered, never
    /// routed (found by the chaos suite's `kill_orchestrator`).
    ///
    /// For the same reason it waits in place, with the retry backoff and until shutdown,
    /// while the ledger or the session store is unreachable
    /// ([`OrchestratorError::is_backend_outage`]): a database restart outlasts the quick
    /// retries of the delivery limit.
    async fn handle(
        &self,
        message: std::result::Result<EventMessage, DecodeError>,
        shutdown: &Shutdown,
    ) -> Result<RouteOutcome> {
        let message = message?;
        let span = tracing::info_span!("route", event_id = %message.event_id);
        let give_up = tokio::time::Instant::now() + self.options.route_lock_ttl;
        let mut outages = 0u32;
        loop {
            match self.route(&message).instrument(span.clone()).await {
                Err(OrchestratorError::RouteInProgress(_))
                    if tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(ROUTE_LOCK_POLL).await;
                }
                Err(error) if error.is_backend_outage() && !shutdown.is_shutting_down() => {
                    tracing::warn!(%error, event_id = %message.event_id, attempt = outages, "backend unreachable; retrying the event in place");
                    if !pause(self.options.retry_delay(outages), shutdown.as_ref()).await {
                        return Err(error);
                    }
                    outages = outages.saturating_add(1);
                }
                outcome => return outcome,
            }
        }
    }
}

/// How often a consumer waiting for another's route lock tries again (see `handle`).
const ROUTE_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Most deliveries of a shard taken in one batch (and routed side by side, by lane).
const MAX_ROUTE_BATCH: usize = 64;

/// Consumes events shard `shard` until shutdown. The deliveries ready at once are routed
/// side by side, one task per ordering lane ([`EventMessage::lane`]), each lane in
/// publication order, so the events of one conversation are routed in order while those of
/// other conversations do not wait for them, and the runs they start share commits.
pub async fn run_shard(router: Arc<EventRouter>, shard: u32, shutdown: Shutdown) {
    let queue = router.deps.topology.events_queue(shard);
    let options = &router.options;
    let consumer = ConsumeLoop {
        bus: router.deps.bus.as_ref(),
        queue: &queue,
        prefetch: options.prefetch,
        max_batch: MAX_ROUTE_BATCH,
        retry: options.retry,
    };
    consumer
        .run(None, shutdown.as_ref(), |batch| async {
            let decoded = batch.into_iter().map(|delivery| {
                let message = messages::decode::<EventMessage>(&delivery.body);
                (delivery, message)
            });
            let lane =
                |(_, message): &(Delivery, std::result::Result<EventMessage, DecodeError>)| {
                    message.as_ref().ok().and_then(|m| m.lane)
                };
            for segment in segments(decoded.collect(), lane) {
                futures::future::join_all(segment.into_iter().map(|lane| async {
                    for (delivery, message) in lane {
                        let outcome = router.handle(message, &shutdown).await.map(|_| ());
                        settle_outcome(
                            delivery,
                            &outcome,
                            &queue.name,
                            &options.retry,
                            shutdown.as_ref(),
                        )
                        .await;
                    }
                }))
                .await;
            }
        })
        .await;
}

/// Lanes that may run side by side, each a list of items to handle in order.
type Segment<T> = Vec<Vec<T>>;

/// Splits `items` (in delivery order) into segments run one after the other, each a set of
/// lanes that may run side by side, each lane in the items' order. An item without a lane
/// is a segment of its own: everything before it runs first, everything after it later.
fn segments<T>(items: Vec<T>, lane: impl Fn(&T) -> Option<u64>) -> Vec<Segment<T>> {
    let mut segments = Vec::new();
    let mut lanes: Segment<T> = Vec::new();
    let mut index: HashMap<u64, usize> = HashMap::new();
    for item in items {
        match lane(&item) {
            Some(key) => match index.get(&key) {
                Some(&at) => lanes[at].push(item),
                None => {
                    index.insert(key, lanes.len());
                    lanes.push(vec![item]);
                }
            },
            None => {
                if !lanes.is_empty() {
                    segments.push(std::mem::take(&mut lanes));
                    index.clear();
                }
                segments.push(vec![vec![item]]);
            }
        }
    }
    if !lanes.is_empty() {
        segments.push(lanes);
    }
    segments
}

#[cfg(test)]
mod tests {
    use super::{Segment, segments};

    /// A named item and its lane.
    type Item = (&'static str, Option<u64>);

    #[test]
    fn lanes_keep_their_order_and_laneless_items_stand_alone() {
        // (name, lane)
        let items = vec![
            ("a1", Some(1)),
            ("b1", Some(2)),
            ("a2", Some(1)),
            ("c1", Some(3)),
            ("x", None),
            ("a3", Some(1)),
            ("y", None),
            ("z", None),
        ];
        let names = |segments: Vec<Segment<Item>>| {
            segments
                .into_iter()
                .map(|lanes| {
                    lanes
                        .into_iter()
                        .map(|lane| lane.into_iter().map(|(name, _)| name).collect::<Vec<_>>())
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(segments(items, |(_, lane)| *lane)),
            vec![
                vec![vec!["a1", "a2"], vec!["b1"], vec!["c1"]],
                vec![vec!["x"]],
                vec![vec!["a3"]],
                vec![vec!["y"]],
                vec![vec!["z"]],
            ]
        );
        assert!(segments(Vec::<u8>::new(), |_| Some(1)).is_empty());
    }
}
