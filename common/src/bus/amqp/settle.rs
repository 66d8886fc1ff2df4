//! Settling the deliveries of one consumer channel, acks coalesced.
//!
//! A quorum queue writes every settlement to its Raft log, so acking one delivery at a time
//! costs the broker about as much as delivering it. Measured on this project's RabbitMQ
//! (3.10) with `scripts/amqp_ack_cost.py`: consuming with one ack per delivery cost 85 µs of
//! broker CPU per message; acking 32 at a time with `multiple` cost 25 µs. So the deliveries
//! of a channel are settled by one task that takes every settlement already asked for and
//! acks what it can with one `basic.ack(multiple = true)`.
//!
//! `multiple` acks every unsettled delivery of the channel up to a tag, so it may only reach
//! as far as the oldest delivery still being handled: a worker holds a run's job unsettled
//! while the run goes on, and a later job that ends first is acked on its own
//! ([`frames`] decides). Nothing waits for more to coalesce: the task sends what is pending
//! as soon as it wakes, and what is asked for while it sends goes into the next frames
//! (natural batching), so one delivery alone is acked as fast as before.
//!
//! [`Delivery::ack`](crate::bus::Delivery::ack) returns once the settlement is handed to the
//! task. A settlement that then fails (the connection drops before the frame goes out) is the
//! case every consumer already handles: the broker redelivers the message. Before a
//! subscription closes its channel, it finishes the task ([`ChannelSettler::finish`]), so a
//! consumer that stops does not get back what it had settled.

use std::collections::BTreeSet;
use std::time::Duration;

use amqprs::channel::{BasicAckArguments, BasicNackArguments};
use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use super::channel::Chan;
use crate::bus::{BusError, Result, Settlement, Settler};
use crate::telemetry::{Metrics, names};

/// Most commands taken into one round of frames, so a channel under constant load still
/// sends its frames regularly.
const MAX_ROUND: usize = 4096;

/// A delivery's number on its channel.
type DeliveryTag = u64;

/// What the settling task of a channel is told, in the order it happened.
#[derive(Debug)]
enum Command {
    /// The channel delivered this tag: it is unsettled until settled.
    Delivered(DeliveryTag),
    /// Settle this delivery.
    Settle(DeliveryTag, Settlement),
    /// Send everything asked before and end: the channel is about to close, and a frame sent
    /// after that would reach a channel the broker no longer has (RabbitMQ answers that by
    /// closing the whole connection) or, once amqprs reuses its number, another channel.
    Finish(oneshot::Sender<()>),
}

/// One AMQP frame that settles deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Frame {
    /// `basic.ack`; `multiple` acks every unsettled delivery up to `tag` as well.
    Ack { tag: DeliveryTag, multiple: bool },
    /// `basic.nack` of one delivery.
    Nack { tag: DeliveryTag, requeue: bool },
}

/// The frames that settle one round: the nacks first, each alone (a `multiple` ack sent
/// before a nack would ack the nacked delivery); then one ack, `multiple` when it covers
/// more than one, up to the highest acked tag below every delivery still `unsettled`; then
/// the acked tags above that, each alone. `acks` may come in any order.
pub(super) fn frames(
    unsettled: &BTreeSet<DeliveryTag>,
    nacks: &[(DeliveryTag, bool)],
    acks: &mut [DeliveryTag],
) -> Vec<Frame> {
    let mut frames: Vec<Frame> = nacks
        .iter()
        .map(|&(tag, requeue)| Frame::Nack { tag, requeue })
        .collect();
    acks.sort_unstable();
    let floor = unsettled.first().copied().unwrap_or(DeliveryTag::MAX);
    let below = acks.partition_point(|&tag| tag < floor);
    if let Some(&highest) = acks[..below].last() {
        frames.push(Frame::Ack {
            tag: highest,
            multiple: below > 1,
        });
    }
    frames.extend(acks[below..].iter().map(|&tag| Frame::Ack {
        tag,
        multiple: false,
    }));
    frames
}

/// The handle of a channel's settling task: told of every delivery before the consumer
/// sees it, then of its settlement. Each delivery holds a clone, so it holds only what a
/// settlement needs: the task's queue and the channel.
#[derive(Clone)]
pub(super) struct ChannelSettler {
    commands: mpsc::UnboundedSender<Command>,
    channel: Chan,
}

impl ChannelSettler {
    /// Starts the settling task of `channel`, a consumer of `queue`; `timeout` bounds
    /// sending one round of frames (a connection that died silently never completes a send).
    pub(super) fn start(channel: Chan, queue: String, timeout: Duration) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(channel.clone(), queue, rx, timeout));
        Self { commands, channel }
    }

    /// Records a delivery of the channel and returns its half of the settlement.
    pub(super) fn delivered(&self, tag: DeliveryTag) -> Box<dyn Settler> {
        let _ = self.commands.send(Command::Delivered(tag));
        Box::new(DeliverySettler {
            tag,
            channel: self.clone(),
        })
    }

    /// Waits (at most `timeout`) until every settlement asked for so far is sent, and ends
    /// the task: the caller closes the channel next (see [`Command::Finish`]); a settlement
    /// asked for after that fails as one on a closed channel does.
    pub(super) async fn finish(&self, timeout: Duration) {
        let (done, sent) = oneshot::channel();
        if self.commands.send(Command::Finish(done)).is_ok() {
            let _ = tokio::time::timeout(timeout, sent).await;
        }
    }
}

/// The settlement half of one delivery.
struct DeliverySettler {
    tag: DeliveryTag,
    channel: ChannelSettler,
}

#[async_trait]
impl Settler for DeliverySettler {
    async fn settle(&self, settlement: Settlement) -> Result<()> {
        let closed = || {
            BusError::Unavailable(
                "the delivery's channel is closed; the broker requeued the message".into(),
            )
        };
        if !self.channel.channel.is_open() {
            return Err(closed());
        }
        self.channel
            .commands
            .send(Command::Settle(self.tag, settlement))
            .map_err(|_| closed())
    }

    fn requeue_on_drop(&self) {
        // Once the channel is gone the broker has requeued it already.
        let _ = self.channel.commands.send(Command::Settle(
            self.tag,
            Settlement::Nack { requeue: true },
        ));
    }
}

/// Where the settling task sends its frames: the consumer's channel (a test's fake).
#[async_trait]
trait Transport: Send + Sync {
    /// Whether frames may still be sent.
    fn is_open(&self) -> bool;
    /// Sends one round's frames in order (within `timeout`); `false` if they did not all go.
    async fn send(&self, round: &[Frame], timeout: Duration) -> bool;
    /// Closes the channel: the broker requeues every delivery it has not seen settled.
    async fn close(&self, timeout: Duration);
}

#[async_trait]
impl Transport for Chan {
    fn is_open(&self) -> bool {
        Chan::is_open(self)
    }

    async fn send(&self, round: &[Frame], timeout: Duration) -> bool {
        send(self, round, timeout).await
    }

    async fn close(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.clone().close()).await;
    }
}

/// The settling task: each round takes every command already waiting and sends the frames
/// [`frames`] decides, counted in `sb_bus_settle_frames_total`; ends when every handle is
/// gone.
///
/// A round that did not go out whole gives the channel up. Its tags have left `unsettled`,
/// so a later round's `multiple` ack could cover one whose nack never reached the broker —
/// acking a delivery its consumer wanted back or dead-lettered. Closed instead, the channel
/// takes its unsettled deliveries back to their queue, and nothing more is sent on it (a
/// settlement asked for afterwards fails as on any closed channel).
async fn run(
    channel: impl Transport,
    queue: String,
    mut commands: mpsc::UnboundedReceiver<Command>,
    timeout: Duration,
) {
    let mut given_up = false;
    let mut unsettled = BTreeSet::new();
    let (mut acks, mut nacks) = (Vec::new(), Vec::new());
    while let Some(first) = commands.recv().await {
        let mut next = Some(first);
        let mut taken = 0;
        let mut finished = None;
        while let Some(command) = next {
            match command {
                Command::Delivered(tag) => {
                    unsettled.insert(tag);
                }
                // A tag settled twice (or never delivered) is ignored: the first one counts.
                Command::Settle(tag, settlement) if unsettled.remove(&tag) => match settlement {
                    Settlement::Ack => acks.push(tag),
                    Settlement::Nack { requeue } => nacks.push((tag, requeue)),
                },
                Command::Settle(..) => {}
                Command::Finish(done) => {
                    finished = Some(done);
                    break;
                }
            }
            taken += 1;
            next = if taken < MAX_ROUND {
                commands.try_recv().ok()
            } else {
                None
            };
        }
        let round = frames(&unsettled, &nacks, &mut acks);
        // A channel already closed (by the broker, or with its connection) took its
        // deliveries' record with it: nothing to send.
        if !round.is_empty() && channel.is_open() && !given_up {
            if channel.send(&round, timeout).await {
                Metrics::global().add(
                    names::BUS_SETTLE_FRAMES_TOTAL,
                    &[("queue", &queue)],
                    round.len() as u64,
                );
            } else {
                given_up = true;
                channel.close(timeout).await;
            }
        }
        acks.clear();
        nacks.clear();
        if let Some(done) = finished {
            let _ = done.send(());
            return;
        }
    }
}

/// Sends one round's frames in order; `false` if they did not all go (the task then closes
/// the channel: its unsettled deliveries are redelivered, which every consumer handles).
async fn send(channel: &Chan, round: &[Frame], timeout: Duration) -> bool {
    // Each frame is handed to the connection's writer in turn, so they leave in `round`'s
    // order.
    let sends = async {
        for &frame in round {
            let sent = match frame {
                Frame::Ack { tag, multiple } => {
                    let ack = BasicAckArguments::new(tag, multiple);
                    channel.channel.basic_ack(ack).await
                }
                Frame::Nack { tag, requeue } => {
                    let nack = BasicNackArguments::new(tag, false, requeue);
                    channel.channel.basic_nack(nack).await
                }
            };
            sent?;
        }
        Ok::<(), amqprs::error::Error>(())
    };
    match tokio::time::timeout(timeout, sends).await {
        Ok(Ok(())) => true,
        Ok(Err(error)) => {
            tracing::debug!(%error, "could not settle deliveries; the broker redelivers them");
            false
        }
        Err(_) => {
            tracing::debug!("timed out settling deliveries; the broker redelivers them");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn set(tags: &[u64]) -> BTreeSet<u64> {
        tags.iter().copied().collect()
    }

    #[test]
    fn acks_below_every_unsettled_delivery_go_as_one_multiple_ack() {
        assert_eq!(
            frames(&set(&[]), &[], &mut [3, 1, 2]),
            [Frame::Ack {
                tag: 3,
                multiple: true
            }]
        );
        assert_eq!(
            frames(&set(&[9]), &[], &mut [4]),
            [Frame::Ack {
                tag: 4,
                multiple: false
            }],
            "one ack alone is a plain ack"
        );
    }

    #[test]
    fn a_multiple_ack_stops_below_a_delivery_still_being_handled() {
        // Tag 2 is still held (a long run's job): 1 may be covered, 3 and 5 go alone.
        assert_eq!(
            frames(&set(&[2, 4]), &[], &mut [5, 1, 3]),
            [
                Frame::Ack {
                    tag: 1,
                    multiple: false
                },
                Frame::Ack {
                    tag: 3,
                    multiple: false
                },
                Frame::Ack {
                    tag: 5,
                    multiple: false
                },
            ]
        );
    }

    /// A channel that fails its first round and records what it is sent after.
    #[derive(Default)]
    struct FailsFirstRound {
        rounds: std::sync::Mutex<Vec<Vec<Frame>>>,
        closed: std::sync::atomic::AtomicBool,
    }

    #[async_trait]
    impl Transport for Arc<FailsFirstRound> {
        fn is_open(&self) -> bool {
            !self.closed.load(std::sync::atomic::Ordering::SeqCst)
        }

        async fn send(&self, round: &[Frame], _: Duration) -> bool {
            let mut rounds = self.rounds.lock().unwrap();
            rounds.push(round.to_vec());
            rounds.len() > 1
        }

        async fn close(&self, _: Duration) {
            self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Review finding: a nack lost with a failed round must not be acked by a later round's
    /// `multiple` ack. The channel is given up instead (the broker requeues it).
    #[tokio::test]
    async fn a_failed_round_gives_the_channel_up_instead_of_acking_past_a_lost_nack() {
        let channel = Arc::new(FailsFirstRound::default());
        let (commands, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(
            Arc::clone(&channel),
            "q".into(),
            rx,
            Duration::from_secs(1),
        ));
        let round = |batch: Vec<Command>| {
            for command in batch {
                commands.send(command).unwrap();
            }
        };
        round(vec![
            Command::Delivered(1),
            Command::Delivered(2),
            Command::Delivered(3),
            Command::Settle(1, Settlement::Nack { requeue: true }),
        ]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        round(vec![
            Command::Settle(2, Settlement::Ack),
            Command::Settle(3, Settlement::Ack),
        ]);
        let (done, finished) = oneshot::channel();
        commands.send(Command::Finish(done)).unwrap();
        finished.await.unwrap();
        task.await.unwrap();
        let rounds = channel.rounds.lock().unwrap().clone();
        assert_eq!(
            rounds,
            [vec![Frame::Nack {
                tag: 1,
                requeue: true
            }]],
            "nothing is sent after the failed round"
        );
        assert!(channel.closed.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn nacks_go_first_so_no_multiple_ack_covers_them() {
        assert_eq!(
            frames(&set(&[]), &[(2, true), (3, false)], &mut [1, 4]),
            [
                Frame::Nack {
                    tag: 2,
                    requeue: true
                },
                Frame::Nack {
                    tag: 3,
                    requeue: false
                },
                Frame::Ack {
                    tag: 4,
                    multiple: true
                },
            ]
        );
        assert!(frames(&set(&[1]), &[], &mut []).is_empty());
    }
}
