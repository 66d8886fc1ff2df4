//! The per-shard consume loop: the events of the deliveries ready at once (a delivery holds
//! one event, or an outbox round's [`EventBatch`](messages::EventBatch)), routed side by side
//! by lane (each lane in order); a delivery is settled when the last of its events is handled.
//!
//! ```text
//!  batch:  a1 b1 a2 c1 ·x· a3        (a, b, c: lanes; x: a message without a lane)
//!  segment 1:  a: a1 → a2            segment 2: x       segment 3: a: a3
//!              b: b1                 (alone)
//!              c: c1
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt as _;
use sb_common::bus::Delivery;
use sb_common::bus::consumer::{ConsumeLoop, pause, settle_outcome};
use sb_common::shutdown::Shutdown;
use sb_protocol::error::{Disposition, HasErrorCode as _};
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

/// Most deliveries of a shard taken in one batch, and most lanes routed side by side.
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
            // Each delivery's events ([`messages::decode_events`]: one, or an outbox round's
            // batch), each with its delivery's index; a body that does not decode is one
            // item that fails.
            let mut events = Vec::with_capacity(batch.len());
            let mut pending = Vec::with_capacity(batch.len());
            for (at, delivery) in batch.into_iter().enumerate() {
                let decoded = match messages::decode_events(&delivery.body) {
                    Ok(decoded) => decoded.into_iter().map(Ok).collect(),
                    Err(error) => vec![Err(error)],
                };
                pending.push(Pending {
                    left: decoded.len(),
                    delivery: Some(delivery),
                    outcome: Ok(()),
                });
                events.extend(decoded.into_iter().map(|message| (at, message)));
            }
            let pending = std::sync::Mutex::new(pending);
            let lane = |(_, message): &(usize, std::result::Result<EventMessage, DecodeError>)| {
                message.as_ref().ok().and_then(|m| m.lane)
            };
            for segment in segments(events, lane) {
                // Batches of events make a segment's lanes as many as its events: at most
                // `MAX_ROUTE_BATCH` are routed at once, as when each delivery held one.
                let lanes = futures::stream::iter(segment);
                lanes
                    .for_each_concurrent(MAX_ROUTE_BATCH, |lane| async {
                        for (at, message) in lane {
                            let outcome = router.handle(message, &shutdown).await.map(|_| ());
                            let done = pending
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)[at]
                                .handled(outcome);
                            if let Some((delivery, outcome)) = done {
                                settle_outcome(
                                    delivery,
                                    &outcome,
                                    &queue.name,
                                    &options.retry,
                                    shutdown.as_ref(),
                                )
                                .await;
                            }
                        }
                    })
                    .await;
            }
        })
        .await;
}

/// A delivery whose events are being routed: settled once the last of them is handled, by
/// the outcome that asks most of the broker (see [`Pending::handled`]).
struct Pending {
    /// Events not handled yet.
    left: usize,
    /// Taken when the last event is handled.
    delivery: Option<Delivery>,
    /// The outcome to settle with so far.
    outcome: Result<()>,
}

impl Pending {
    /// Records an event's outcome; after the last one, the delivery and the outcome to
    /// settle it with. A retry wins over a dead letter, which wins over a final error,
    /// which wins over success: a requeued batch is routed again whole (its routed events
    /// are then found handled and skipped), and one dead-lettered keeps the event that needs
    /// a human, its routed companions alongside.
    fn handled(&mut self, outcome: Result<()>) -> Option<(Delivery, Result<()>)> {
        if severity(&outcome) > severity(&self.outcome) {
            self.outcome = outcome;
        }
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return None;
        }
        let outcome = std::mem::replace(&mut self.outcome, Ok(()));
        self.delivery.take().map(|delivery| (delivery, outcome))
    }
}

/// How much an outcome asks of the broker when its delivery is settled (see
/// [`Pending::handled`]).
fn severity(outcome: &Result<()>) -> u8 {
    match outcome {
        Ok(()) => 0,
        Err(error) => match error.code().disposition() {
            Disposition::Ack => 1,
            Disposition::DeadLetter => 2,
            Disposition::Retry => 3,
        },
    }
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
    use super::{Pending, Segment, segments};
    use crate::error::OrchestratorError;
    use sb_protocol::ids::EventId;

    #[test]
    fn a_batch_keeps_the_outcome_that_asks_most_of_the_broker() {
        let not_found = || Err(OrchestratorError::EventNotFound(EventId::new())); // ack
        let broken = || {
            Err(OrchestratorError::BadEnvelope {
                event_id: EventId::new(),
                reason: "test".into(),
            })
        }; // dead letter
        let busy = || Err(OrchestratorError::RouteInProgress(EventId::new())); // retry
        let mut batch = Pending {
            left: 9,
            delivery: None,
            outcome: Ok(()),
        };
        let kept = |batch: &Pending| match &batch.outcome {
            Ok(()) => "ok",
            Err(OrchestratorError::EventNotFound(_)) => "final",
            Err(OrchestratorError::BadEnvelope { .. }) => "dead letter",
            Err(OrchestratorError::RouteInProgress(_)) => "retry",
            Err(_) => "other",
        };
        assert!(batch.handled(Ok(())).is_none());
        assert_eq!(kept(&batch), "ok");
        batch.handled(not_found());
        assert_eq!(kept(&batch), "final");
        batch.handled(Ok(()));
        assert_eq!(kept(&batch), "final");
        batch.handled(broken());
        assert_eq!(kept(&batch), "dead letter");
        batch.handled(not_found());
        assert_eq!(kept(&batch), "dead letter");
        batch.handled(busy());
        assert_eq!(kept(&batch), "retry");
        batch.handled(broken());
        assert_eq!(kept(&batch), "retry");
        assert_eq!(batch.left, 2);
    }

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
