//! Dead letters on RabbitMQ: [`DeadLetters`] for [`AmqpBus`], each operation on a channel of
//! its own (see the impl's doc for how much a walk takes and why).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use amqprs::channel::{
    BasicAckArguments, BasicGetArguments, BasicNackArguments, GetMessage, QueuePurgeArguments,
};
use amqprs::{BasicProperties, FieldArray, FieldTable, FieldValue};
use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use super::AmqpBus;
use super::channel::{Chan, ClientResult};
use super::declare::passive_queue;
use super::failure::{AmqpError, Failure, classify};
use super::link::{Inner, Link, RETRY_PAUSE};
use super::properties::{field_name, header_count, header_text};
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
                    dead.keep(message.0.delivery_tag());
                    if letters.len() < limit {
                        letters.push(dead_letter(position, &message));
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
            let tag = message.0.delivery_tag();
            let letter = dead_letter(taken, &message);
            let Step::Replay {
                exchange,
                routing_key,
            } = walk.next(&letter)
            else {
                dead.keep(tag);
                continue;
            };
            let properties = replay_properties(&message.1);
            let published = inner
                .publish_with_properties(
                    &exchange,
                    &routing_key,
                    &message.2,
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
                        dead.keep(message.0.delivery_tag());
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
                ch.call(ch.channel.queue_purge(QueuePurgeArguments::new(name)))
                    .await
            })
            .await
        });
        let purged = tokio::time::timeout(self.inner.options.operation_timeout, purge)
            .await
            .map_err(|_| BusError::Unavailable(format!("timed out purging {name:?}")))??;
        Ok(u64::from(purged.unwrap_or_default()))
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
    channel: Chan,
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
            let channel = Chan::open(&link.connection, None).await?;
            let declared = channel
                .call(channel.channel.queue_declare(passive_queue(queue)))
                .await?;
            let total = declared.map_or(0, |(_, messages, _)| messages);
            Ok((link, channel, total))
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
    async fn take(&self) -> Result<Option<GetMessage>> {
        let get = BasicGetArguments::new(self.queue).no_ack(false).finish();
        self.call(self.channel.channel.basic_get(get)).await
    }

    /// Keeps a taken message: it goes back with [`give_back`](Self::give_back).
    fn keep(&mut self, tag: u64) {
        self.kept = self.kept.max(Some(tag));
    }

    /// Removes a taken message for good.
    async fn remove(&self, tag: u64) -> Result<()> {
        self.call(
            self.channel
                .channel
                .basic_ack(BasicAckArguments::new(tag, false)),
        )
        .await
    }

    /// Gives back every kept message with one `basic.nack(multiple, requeue)` — not
    /// `basic.reject` or a channel close, which RabbitMQ 4.3+ counts as a failed delivery of
    /// the message — waits (at most [`GIVE_BACK_SETTLE`]) until the queue counts
    /// `expected_ready` messages again, and closes the channel (which returns anything still
    /// held if the nack did not go out).
    async fn give_back(self, expected_ready: usize) {
        if let Some(tag) = self.kept {
            let nack = self
                .channel
                .channel
                .basic_nack(BasicNackArguments::new(tag, true, true));
            if let Err(error) = self.call(nack).await {
                tracing::debug!(%error, queue = self.queue, "giving back dead letters failed; closing the channel returns them");
            }
            let deadline = Instant::now() + GIVE_BACK_SETTLE;
            while Instant::now() < deadline {
                let declared = self
                    .call(
                        self.channel
                            .channel
                            .queue_declare(passive_queue(self.queue)),
                    )
                    .await;
                match declared {
                    Ok(Some((_, messages, _))) if messages as usize >= expected_ready => break,
                    Ok(_) => tokio::time::sleep(RETRY_PAUSE).await,
                    Err(_) => break,
                }
            }
        }
        let closing = self.channel.close();
        let _ = tokio::time::timeout(self.inner.options.operation_timeout, closing).await;
    }

    /// One broker call, bounded by the operation timeout (a connection that died silently
    /// would hang it) and mapped to a [`BusError`].
    async fn call<T>(&self, call: impl Future<Output = ClientResult<T>>) -> Result<T> {
        let call = self.channel.call(call);
        let error: AmqpError =
            match tokio::time::timeout(self.inner.options.operation_timeout, call).await {
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
                if matches!(failure, Failure::Connection) || !self.link.connection.is_open() {
                    self.inner.report_broken(self.link.generation);
                }
                Err(BusError::Unavailable(format!(
                    "broker operation failed: {error}"
                )))
            }
        }
    }
}

/// A message taken from a dead-letter queue, as a [`DeadLetter`] at `position`.
fn dead_letter(position: usize, (taken, properties, body): &GetMessage) -> DeadLetter {
    let message_id = properties.message_id().cloned();
    DeadLetter {
        position,
        id: message_id.clone().unwrap_or_else(|| content_id(body)),
        message_id,
        message_type: properties.message_type().cloned(),
        death: properties
            .headers()
            .and_then(|headers| death_of(headers, taken.routing_key())),
        body: Bytes::copy_from_slice(body),
    }
}

/// The values of an array header, in order.
fn array_values(value: &FieldValue) -> Vec<FieldValue> {
    match value {
        FieldValue::A(array) => Vec::from(FieldArray::clone(array)),
        _ => Vec::new(),
    }
}

/// The latest death recorded in a dead letter's headers: the first entry of `x-death` (newest
/// first), else the `x-first-death-*` summary. `routing_key` (the key it was dead-lettered
/// with, the original one) fills in what the entry lacks.
fn death_of(headers: &FieldTable, routing_key: &str) -> Option<Death> {
    let get = |table: &FieldTable, name: &str| table.get(&field_name(name)).cloned();
    let latest = get(headers, "x-death").and_then(|deaths| {
        array_values(&deaths)
            .into_iter()
            .find_map(|death| match death {
                FieldValue::F(entry) => Some(entry),
                _ => None,
            })
    });
    let reason = |value: Option<FieldValue>| {
        value.as_ref().and_then(header_text).map_or_else(
            || DeathReason::Other("unknown".into()),
            |r| DeathReason::parse(&r),
        )
    };
    if let Some(entry) = latest {
        if let Some(exchange) = get(&entry, "exchange").as_ref().and_then(header_text) {
            let first_key = get(&entry, "routing-keys")
                .and_then(|keys| array_values(&keys).first().and_then(header_text));
            return Some(Death {
                exchange,
                routing_key: first_key.unwrap_or_else(|| routing_key.to_owned()),
                queue: get(&entry, "queue")
                    .as_ref()
                    .and_then(header_text)
                    .unwrap_or_default(),
                reason: reason(get(&entry, "reason")),
                count: get(&entry, "count")
                    .as_ref()
                    .and_then(header_count)
                    .unwrap_or(1),
            });
        }
    }
    Some(Death {
        exchange: get(headers, "x-first-death-exchange")
            .as_ref()
            .and_then(header_text)?,
        routing_key: routing_key.to_owned(),
        queue: get(headers, "x-first-death-queue")
            .as_ref()
            .and_then(header_text)
            .unwrap_or_default(),
        reason: reason(get(headers, "x-first-death-reason")),
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
    let mut properties = BasicProperties::default();
    properties.with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        properties.with_content_type(v);
    }
    if let Some(v) = original.content_encoding() {
        properties.with_content_encoding(v);
    }
    if let Some(v) = original.priority() {
        properties.with_priority(v);
    }
    if let Some(v) = original.correlation_id() {
        properties.with_correlation_id(v);
    }
    if let Some(v) = original.reply_to() {
        properties.with_reply_to(v);
    }
    if let Some(v) = original.message_id() {
        properties.with_message_id(v);
    }
    if let Some(v) = original.timestamp() {
        properties.with_timestamp(v);
    }
    if let Some(v) = original.message_type() {
        properties.with_message_type(v);
    }
    if let Some(v) = original.app_id() {
        properties.with_app_id(v);
    }
    if let Some(headers) = original.headers() {
        let mut kept = FieldTable::new();
        for (name, value) in AsRef::<std::collections::HashMap<_, _>>::as_ref(headers) {
            if !AsRef::<String>::as_ref(name).starts_with("x-") {
                kept.insert(name.clone(), value.clone());
            }
        }
        if !AsRef::<std::collections::HashMap<_, _>>::as_ref(&kept).is_empty() {
            properties.with_headers(kept);
        }
    }
    properties
}
