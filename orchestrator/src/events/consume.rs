//! The per-shard consume loop: the events of the deliveries ready at once (a delivery holds
//! one event, or an outbox round's [`EventBatch`](messages::EventBatch)), routed side by side
//! by lane (each lane in order); a delivery is settled when the last of its events is handled,
//! whole, or — a batch routed only in part — acked with its unrouted events sent again on
//! their own ([`Settlement`]).
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
                pending.push(Pending::new(Some(delivery), decoded.len()));
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
                            let event = message.as_ref().ok().cloned();
                            let outcome = router.handle(message, &shutdown).await.map(|_| ());
                            let done = pending
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)[at]
                                .handled(event, outcome);
                            if let Some((delivery, settlement)) = done {
                                let outcome = match settlement {
                                    Settlement::Whole(outcome) => outcome,
                                    Settlement::Apart { events, otherwise } => {
                                        router.republish(&delivery, events).await.or(otherwise)
                                    }
                                };
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

/// A delivery whose events are being routed: settled once the last of them is handled
/// ([`Pending::handled`]).
struct Pending {
    /// Events the delivery holds.
    events: usize,
    /// Events not handled yet.
    left: usize,
    /// Taken when the last event is handled.
    delivery: Option<Delivery>,
    /// The outcome that asks most of the broker so far ([`severity`]).
    worst: Result<()>,
    /// The events whose outcome was not final: to be retried or dead-lettered.
    unsettled: Vec<EventMessage>,
}

/// How a delivery whose events were all handled is settled.
#[derive(Debug)]
enum Settlement {
    /// As a whole, by this outcome.
    Whole(Result<()>),
    /// Some of its events (not all) are to be retried or dead-lettered: those go again in a
    /// message of their own ([`EventRouter::republish`]) and the delivery is acked, so the
    /// others are not routed again (routing an event whose run is still queued publishes its
    /// job again, with a new Host API token). If that publish fails, the delivery is settled
    /// as a whole by `otherwise`.
    Apart {
        events: Vec<EventMessage>,
        otherwise: Result<()>,
    },
}

impl Pending {
    /// `delivery`, holding `events` events, none handled yet.
    fn new(delivery: Option<Delivery>, events: usize) -> Self {
        Self {
            events,
            left: events,
            delivery,
            worst: Ok(()),
            unsettled: Vec::new(),
        }
    }

    /// Records the outcome of one of the delivery's events; after the last one, the delivery
    /// and how to settle it ([`Pending::record`]).
    fn handled(
        &mut self,
        event: Option<EventMessage>,
        outcome: Result<()>,
    ) -> Option<(Delivery, Settlement)> {
        let settlement = self.record(event, outcome)?;
        self.delivery.take().map(|delivery| (delivery, settlement))
    }

    /// Records the outcome of one of the delivery's events (`event`: `None` for a body that
    /// did not decode, the delivery's only item); after the last one, how to settle the
    /// delivery. One of a single event, or whose events were all routed or all not, is
    /// settled whole by the outcome that asks most of the broker (retry > dead letter > final
    /// error > success); a batch routed only in part is settled [`Settlement::Apart`].
    fn record(&mut self, event: Option<EventMessage>, outcome: Result<()>) -> Option<Settlement> {
        if !is_final(&outcome) {
            self.unsettled.extend(event);
        }
        if severity(&outcome) > severity(&self.worst) {
            self.worst = outcome;
        }
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return None;
        }
        let worst = std::mem::replace(&mut self.worst, Ok(()));
        let unsettled = std::mem::take(&mut self.unsettled);
        Some(if unsettled.is_empty() || unsettled.len() == self.events {
            Settlement::Whole(worst)
        } else {
            Settlement::Apart {
                events: unsettled,
                otherwise: worst,
            }
        })
    }
}

/// Whether an outcome is done with its event: success, or a final error (acked).
fn is_final(outcome: &Result<()>) -> bool {
    severity(outcome) <= 1
}

/// How much an outcome asks of the broker when its delivery is settled: 0 success, 1 a
/// final error (ack), 2 dead letter, 3 retry.
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

impl EventRouter {
    /// Publishes `events` of `delivery` again, as a message of their own to the same queue
    /// (confirmed), for [`Settlement::Apart`]. The new message starts its delivery count
    /// afresh, once: when its events fail again they are all of it, and it is settled whole.
    async fn republish(&self, delivery: &Delivery, events: Vec<EventMessage>) -> Result<()> {
        let count = events.len();
        let body = match <[EventMessage; 1]>::try_from(events) {
            Ok([event]) => messages::encode(&event),
            Err(events) => messages::encode(&messages::EventBatch::new(events)),
        };
        self.deps
            .bus
            .publish(
                &delivery.exchange,
                &delivery.routing_key,
                body.into(),
                sb_common::bus::PublishOptions::default(),
            )
            .await?;
        tracing::info!(
            events = count,
            "events of a batch not routed yet go again on their own"
        );
        Ok(())
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
    use super::{Pending, Segment, Settlement, segments};
    use crate::error::{OrchestratorError, Result};
    use sb_protocol::ids::{EventId, WorkspaceId};
    use sb_protocol::messages::EventMessage;

    fn pending(events: usize) -> Pending {
        Pending::new(None, events)
    }

    fn event() -> EventMessage {
        EventMessage::new(WorkspaceId::default_workspace(), EventId::new())
    }

    /// A final error: acked.
    fn not_found() -> Result<()> {
        Err(OrchestratorError::EventNotFound(EventId::new()))
    }

    /// Dead-lettered.
    fn broken() -> Result<()> {
        Err(OrchestratorError::BadEnvelope {
            event_id: EventId::new(),
            reason: "test".into(),
        })
    }

    /// Retried.
    fn busy() -> Result<()> {
        Err(OrchestratorError::RouteInProgress(EventId::new()))
    }

    /// The name of an outcome.
    fn name(outcome: &Result<()>) -> &'static str {
        match outcome {
            Ok(()) => "ok",
            Err(OrchestratorError::EventNotFound(_)) => "final",
            Err(OrchestratorError::BadEnvelope { .. }) => "dead letter",
            Err(OrchestratorError::RouteInProgress(_)) => "retry",
            Err(_) => "other",
        }
    }

    #[test]
    fn a_batch_keeps_the_outcome_that_asks_most_of_the_broker() {
        let mut batch = pending(9);
        let steps = [
            (Ok(()), "ok"),
            (not_found(), "final"),
            (Ok(()), "final"),
            (broken(), "dead letter"),
            (not_found(), "dead letter"),
            (busy(), "retry"),
            (broken(), "retry"),
        ];
        for (outcome, kept) in steps {
            assert!(batch.record(Some(event()), outcome).is_none());
            assert_eq!(name(&batch.worst), kept);
        }
        assert_eq!((batch.left, batch.unsettled.len()), (2, 3));
    }

    /// The settlement of a delivery whose events had `outcomes`, in order.
    fn settled(outcomes: Vec<(EventMessage, Result<()>)>) -> Settlement {
        let mut batch = pending(outcomes.len());
        let mut last = None;
        for (event, outcome) in outcomes {
            assert!(last.is_none(), "settled before its last event");
            last = batch.record(Some(event), outcome);
        }
        last.expect("settled after its last event")
    }

    #[test]
    fn a_batch_routed_in_part_sends_only_the_rest_again() {
        let (a, b, c) = (event(), event(), event());
        // Routed, or a final error: acked whole.
        match settled(vec![(a.clone(), Ok(())), (b.clone(), not_found())]) {
            Settlement::Whole(outcome) => assert_eq!(name(&outcome), "final"),
            other => panic!("{other:?}"),
        }
        // One to retry among routed ones: only it goes again.
        match settled(vec![
            (a.clone(), Ok(())),
            (b.clone(), busy()),
            (c.clone(), Ok(())),
        ]) {
            Settlement::Apart { events, otherwise } => {
                assert_eq!(events, std::slice::from_ref(&b));
                assert_eq!(name(&otherwise), "retry");
            }
            other => panic!("{other:?}"),
        }
        // A dead letter and a retry beside a routed one: both go again, in order.
        match settled(vec![
            (a.clone(), broken()),
            (b.clone(), Ok(())),
            (c.clone(), busy()),
        ]) {
            Settlement::Apart { events, .. } => assert_eq!(events, [a.clone(), c.clone()]),
            other => panic!("{other:?}"),
        }
        // None routed: settled whole, so the broker's count of its deliveries goes on.
        match settled(vec![(a, busy()), (b, broken())]) {
            Settlement::Whole(outcome) => assert_eq!(name(&outcome), "retry"),
            other => panic!("{other:?}"),
        }
        // One event: whole.
        match settled(vec![(c, broken())]) {
            Settlement::Whole(outcome) => assert_eq!(name(&outcome), "dead letter"),
            other => panic!("{other:?}"),
        }
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
