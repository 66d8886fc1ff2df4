//! Dead letters on RabbitMQ: [`DeadLetters`] for [`AmqpBus`], each operation on a channel of
//! its own (see the impl's doc for how much a walk takes and why).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use tokio::time::Instant;

use super::AmqpBus;
use super::failure::{Failure, classify};
use super::link::{Inner, Link, RETRY_PAUSE};
use super::properties::{header_count, header_text};
use crate::bus::dead_letters::{
    DeadLetter, DeadLetterList, DeadLetters, Death, DeathReason, ReplayOptions, ReplayReport,
    ReplayWalk, Step, content_id, refusal_is_per_message,
};
use crate::bus::{BusError, PublishOptions, QueueSpec, QueueType, Result, check_name};

/// Dead letters on RabbitMQ. Every operation works on a `DeadQueue`: a channel of its own,
/// so the messages it takes unacknowledged are exactly those of this call, and closing it
/// (explicitly, or by the broker when the connection drops) returns whatever it still holds.
///
/// How a queue takes back messages decides how much is taken (see the contract on
/// [`DeadLetters`]): a classic queue puts them back at their original positions, so a peek
/// takes only the head it shows; a quorum queue appends them (RabbitMQ 3.10+ without a
/// delivery limit, which is how the dead queue is declared) or serves them first (with one),
/// so every walk over a quorum queue takes *all* its messages and gives back all it keeps, in
/// order — the one way that leaves the order unchanged under both rules.
#[async_trait]
impl DeadLetters for AmqpBus {
    async fn peek(&self, queue: &QueueSpec, limit: usize) -> Result<DeadLetterList> {
        let mut dead = DeadQueue::open(&self.inner, &queue.name).await?;
        let total = dead.total;
        let take = match queue.effective_queue_type() {
            _ if limit == 0 => 0,
            QueueType::Quorum => total,
            QueueType::Classic => limit.min(total),
        };
        let mut letters = Vec::new();
        let mut failure = None;
        for position in 1..=take {
            match dead.take().await {
                Ok(Some(message)) => {
                    dead.keep(message.delivery.delivery_tag);
                    if letters.len() < limit {
                        letters.push(dead_letter(position, &message.delivery));
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        dead.give_back(total).await;
        match failure {
            Some(error) => Err(error),
            None => Ok(DeadLetterList { total, letters }),
        }
    }

    async fn replay(&self, queue: &QueueSpec, options: &ReplayOptions) -> Result<ReplayReport> {
        let inner = &self.inner;
        let mut dead = DeadQueue::open(inner, &queue.name).await?;
        let mut walk = ReplayWalk::new(options, dead.total);
        let mut taken = 0;
        while walk.wants_more() {
            let message = match dead.take().await {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(error) => {
                    walk.report.interrupted = Some(error);
                    break;
                }
            };
            taken += 1;
            let tag = message.delivery.delivery_tag;
            let letter = dead_letter(taken, &message.delivery);
            let Step::Replay {
                exchange,
                routing_key,
            } = walk.next(&letter)
            else {
                dead.keep(tag);
                continue;
            };
            let properties = replay_properties(&message.delivery.properties);
            let published = inner
                .publish_with_properties(
                    &exchange,
                    &routing_key,
                    &message.delivery.data,
                    // Mandatory and confirmed; the properties are the dead letter's.
                    PublishOptions::default(),
                    &properties,
                )
                .await;
            match published {
                // Confirmed by the broker: only now may the dead copy go.
                Ok(()) => match dead.remove(tag).await {
                    Ok(()) => walk.replayed(),
                    Err(error) => {
                        walk.report.interrupted = Some(BusError::Unavailable(format!(
                            "dead letter {} was replayed but stays in the dead queue too: {error}",
                            letter.id
                        )));
                        break;
                    }
                },
                Err(error) if refusal_is_per_message(&error) => {
                    dead.keep(tag);
                    walk.refused(letter, error);
                }
                Err(error) => {
                    dead.keep(tag);
                    walk.report.interrupted = Some(error);
                    break;
                }
            }
        }
        if queue.effective_queue_type() == QueueType::Quorum && walk.report.interrupted.is_none() {
            // Take the rest too, so that what is given back keeps its order (see above).
            while taken < dead.total {
                match dead.take().await {
                    Ok(Some(message)) => {
                        dead.keep(message.delivery.delivery_tag);
                        taken += 1;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let expected_ready = dead.total.saturating_sub(walk.report.replayed);
        dead.give_back(expected_ready).await;
        Ok(walk.report)
    }

    async fn purge(&self, queue: &QueueSpec) -> Result<u64> {
        let name = queue.name.as_str();
        check_name(name)?;
        let purge = self.inner.retrying(|link| async move {
            link.topology_op(|ch| async move {
                ch.queue_purge(name, QueuePurgeOptions::default()).await
            })
            .await
        });
        let purged = tokio::time::timeout(self.inner.options.operation_timeout, purge)
            .await
            .map_err(|_| BusError::Unavailable(format!("timed out purging {name:?}")))??;
        Ok(u64::from(purged))
    }
}

/// How long giving messages back waits for the queue to count them as ready again: RabbitMQ
/// applies returns to a quorum queue asynchronously, after the nack and even after the
/// channel closed, so a replay started right after a peek could find the queue empty.
const GIVE_BACK_SETTLE: Duration = Duration::from_secs(2);

/// A dead-letter queue opened for one operation: its own channel, the number of ready
/// messages when it was opened, and the messages taken and kept so far.
struct DeadQueue<'a> {
    inner: &'a Inner,
    link: Arc<Link>,
    channel: Channel,
    queue: &'a str,
    /// Ready messages when opened: no walk takes more.
    total: usize,
    /// Highest delivery tag taken and kept (not removed): one `basic.nack(multiple)` up to it
    /// gives back every kept message, in order.
    kept: Option<u64>,
}

impl<'a> DeadQueue<'a> {
    /// Opens a channel and counts the queue (retried over a reconnection: nothing is taken
    /// yet). A missing queue is [`BusError::NotFound`].
    async fn open(inner: &'a Inner, queue: &'a str) -> Result<Self> {
        check_name(queue)?;
        let open = inner.retrying(|link| async move {
            let channel = link.connection.create_channel().await?;
            let declared = channel
                .queue_declare(queue, passive(), FieldTable::default())
                .await?;
            Ok((link, channel, declared.message_count()))
        });
        let (link, channel, total) = tokio::time::timeout(inner.options.operation_timeout, open)
            .await
            .map_err(|_| BusError::Unavailable(format!("timed out opening {queue:?}")))??;
        Ok(Self {
            inner,
            link,
            channel,
            queue,
            total: total as usize,
            kept: None,
        })
    }

    /// Takes the next message unacknowledged (`None`: the queue has no ready message).
    async fn take(&self) -> Result<Option<lapin::message::BasicGetMessage>> {
        self.call(
            self.channel
                .basic_get(self.queue, BasicGetOptions { no_ack: false }),
        )
        .await
    }

    /// Keeps a taken message: it goes back with [`give_back`](Self::give_back).
    fn keep(&mut self, tag: u64) {
        self.kept = self.kept.max(Some(tag));
    }

    /// Removes a taken message for good.
    async fn remove(&self, tag: u64) -> Result<()> {
        self.call(self.channel.basic_ack(tag, BasicAckOptions::default()))
            .await
    }

    /// Gives back every kept message with one `basic.nack(multiple, requeue)` — not
    /// `basic.reject` or a channel close, which RabbitMQ 4.3+ counts as a failed delivery of
    /// the message — waits (at most [`GIVE_BACK_SETTLE`]) until the queue counts
    /// `expected_ready` messages again, and closes the channel (which returns anything still
    /// held if the nack did not go out).
    async fn give_back(self, expected_ready: usize) {
        if let Some(tag) = self.kept {
            let nack = self.channel.basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            );
            if let Err(error) = self.call(nack).await {
                tracing::debug!(%error, queue = self.queue, "giving back dead letters failed; closing the channel returns them");
            }
            let deadline = Instant::now() + GIVE_BACK_SETTLE;
            while Instant::now() < deadline {
                let declared = self
                    .call(
                        self.channel
                            .queue_declare(self.queue, passive(), FieldTable::default()),
                    )
                    .await;
                match declared {
                    Ok(queue) if queue.message_count() as usize >= expected_ready => break,
                    Ok(_) => tokio::time::sleep(RETRY_PAUSE).await,
                    Err(_) => break,
                }
            }
        }
        let closing = self.channel.close(200, "dead letters done");
        let _ = tokio::time::timeout(self.inner.options.operation_timeout, closing).await;
    }

    /// One broker call, bounded by the operation timeout (a connection that died silently
    /// would hang it) and mapped to a [`BusError`].
    async fn call<T>(
        &self,
        call: impl Future<Output = std::result::Result<T, lapin::Error>>,
    ) -> Result<T> {
        let error = match tokio::time::timeout(self.inner.options.operation_timeout, call).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) => error,
            Err(_) => {
                return Err(BusError::Unavailable(
                    "timed out waiting for the broker".into(),
                ));
            }
        };
        match classify(&error) {
            Failure::Final(e) => Err(e),
            failure => {
                if matches!(failure, Failure::Connection)
                    || !self.link.connection.status().connected()
                {
                    self.inner.report_broken(self.link.generation);
                }
                Err(BusError::Unavailable(format!(
                    "broker operation failed: {error}"
                )))
            }
        }
    }
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    }
}

/// A message taken from a dead-letter queue, as a [`DeadLetter`] at `position`.
fn dead_letter(position: usize, delivery: &lapin::message::Delivery) -> DeadLetter {
    let properties = &delivery.properties;
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned());
    DeadLetter {
        position,
        id: message_id
            .clone()
            .unwrap_or_else(|| content_id(&delivery.data)),
        message_id,
        message_type: properties
            .kind()
            .as_ref()
            .map(|kind| kind.as_str().to_owned()),
        death: properties
            .headers()
            .as_ref()
            .and_then(|headers| death_of(headers, delivery.routing_key.as_str())),
        body: Bytes::copy_from_slice(&delivery.data),
    }
}

/// The latest death recorded in a dead letter's headers: the first entry of `x-death` (newest
/// first), else the `x-first-death-*` summary. `routing_key` (the key it was dead-lettered
/// with, the original one) fills in what the entry lacks.
fn death_of(headers: &FieldTable, routing_key: &str) -> Option<Death> {
    let headers = headers.inner();
    let latest = match headers.get("x-death") {
        Some(AMQPValue::FieldArray(deaths)) => {
            deaths.as_slice().iter().find_map(|death| match death {
                AMQPValue::FieldTable(entry) => Some(entry.inner()),
                _ => None,
            })
        }
        _ => None,
    };
    let reason = |value: Option<&AMQPValue>| {
        value.and_then(header_text).map_or_else(
            || DeathReason::Other("unknown".into()),
            |r| DeathReason::parse(&r),
        )
    };
    if let Some(entry) = latest {
        if let Some(exchange) = entry.get("exchange").and_then(header_text) {
            let first_key = match entry.get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => keys.as_slice().first().and_then(header_text),
                _ => None,
            };
            return Some(Death {
                exchange,
                routing_key: first_key.unwrap_or_else(|| routing_key.to_owned()),
                queue: entry.get("queue").and_then(header_text).unwrap_or_default(),
                reason: reason(entry.get("reason")),
                count: entry.get("count").and_then(header_count).unwrap_or(1),
            });
        }
    }
    Some(Death {
        exchange: headers
            .get("x-first-death-exchange")
            .and_then(header_text)?,
        routing_key: routing_key.to_owned(),
        queue: headers
            .get("x-first-death-queue")
            .and_then(header_text)
            .unwrap_or_default(),
        reason: reason(headers.get("x-first-death-reason")),
        count: 1,
    })
}

/// Properties of a replayed dead letter: its publisher's, persistent, minus what is not
/// theirs to give again. The `x-` headers (`x-death`, `x-first-death-*`, `x-delivery-count`)
/// are the broker's bookkeeping of the dead copy: without them the replay is a first delivery
/// (`Delivery::delivery_count` 0, so a consumer's retry backoff starts over). `user-id` would
/// have to match this connection's user, and the broker already removed `expiration` when the
/// message died.
fn replay_properties(original: &BasicProperties) -> BasicProperties {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        properties = properties.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        properties = properties.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        properties = properties.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        properties = properties.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        properties = properties.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        properties = properties.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        properties = properties.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        properties = properties.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        properties = properties.with_app_id(v.clone());
    }
    if let Some(headers) = original.headers() {
        let kept: BTreeMap<_, _> = headers
            .inner()
            .iter()
            .filter(|(name, _)| !name.as_str().starts_with("x-"))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        if !kept.is_empty() {
            properties = properties.with_headers(kept.into());
        }
    }
    properties
}
