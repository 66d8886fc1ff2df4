//! Publishing: confirmed (persistent, mandatory, awaited until the broker's ack) and best
//! effort (written on the channel without confirms), one at a time or as a batch.
//!
//! One attempt is sent on the link's channel for its options; [`Inner::judge`] turns its
//! outcome into a result or a retry (a lost connection or a channel closed by someone else's
//! error), and retries publish again until the operation timeout — so a message may be
//! duplicated, never silently lost. A batch sends everything and then awaits every confirm,
//! and only the messages whose outcome was lost are published again, one by one.
//!
//! A broker refusal (`403`, `406`, …) closes the shared publish channel, and every publish in
//! flight on it sees the same reply: the refusal is only known to be a message's own once
//! the broker refuses it **alone**, on a channel of its own. Every other message that saw it
//! is published again. So one message the broker cannot take (say, over its size limit)
//! fails alone, instead of failing the messages beside it with a permanent error their
//! consumers would settle as done.

use amqprs::BasicProperties;
use amqprs::channel::{BasicPublishArguments, ExchangeDeclareArguments};
use futures::future::join_all;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::channel::Chan;
use super::confirms::{Confirmation, Confirms, fingerprint};
use super::failure::{AmqpError, Failure, classify};
use super::link::{Inner, Link, RETRY_PAUSE};
use super::properties::properties;
use crate::bus::{
    BatchPublishError, BusError, Outgoing, PublishOptions, Result, check_key, check_name,
};

impl Inner {
    /// One publish attempt on `link`: send, then await the confirm (unless `options` asks
    /// for none: then the broker's silence is taken as an ack). `alone`: on a confirm channel
    /// of its own, opened for this attempt and closed after it.
    async fn publish_on(
        link: &Link,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
        alone: bool,
    ) -> std::result::Result<Confirmation, AmqpError> {
        if alone && options.confirmed() {
            let (chan, confirms) = Link::publish_channel(&link.connection).await?;
            let confirmation = async {
                Route::Confirmed(&chan, &confirms)
                    .write(exchange, routing_key, body, options, properties.clone())
                    .await?
                    .confirmation()
                    .await
            }
            .await;
            // Closed in a task of its own: a close cut off by the publish's deadline would leave
            // amqprs answering a reply nobody waits for, and the channel's number taken.
            if chan.is_open() {
                tokio::spawn(async move { chan.close().await });
            }
            return confirmation;
        }
        let sent = if options.confirmed() {
            let publisher = link.publisher().await?;
            Route::Confirmed(&publisher.0, &publisher.1)
                .write(exchange, routing_key, body, options, properties.clone())
                .await?
        } else {
            let best_effort = link.best_effort_publisher().await?;
            Route::BestEffort(&best_effort)
                .write(exchange, routing_key, body, options, properties.clone())
                .await?
        };
        sent.confirmation().await
    }

    /// Publishes with retries; see [`Bus::publish`].
    pub(super) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
    ) -> Result<()> {
        self.publish_with_properties(exchange, routing_key, body, options, &properties(options))
            .await
    }

    /// [`publish`](Self::publish) with explicit message properties (a replayed dead letter
    /// keeps its publisher's).
    pub(super) async fn publish_with_properties(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
    ) -> Result<()> {
        let deadline = Instant::now() + self.options.operation_timeout;
        self.publish_attempts(
            exchange,
            routing_key,
            body,
            options,
            properties,
            false,
            deadline,
        )
        .await
    }

    /// Publishes until the message's outcome is known or the operation times out. `alone`:
    /// the message saw a refusal on a shared channel, so a confirmed one is published on a
    /// channel of its own, and a refusal now is its own. (A best-effort message cannot be
    /// asked alone — the broker answers nothing — so it is written once more, and a second
    /// refusal is taken as its own.)
    ///
    /// `deadline` bounds every attempt's publish and confirm, not only the pauses between
    /// attempts: a broker that stops reading (a memory or disk alarm blocks publishing
    /// connections) or never confirms would otherwise hold the publisher forever. A message
    /// whose attempt was cut off may have reached the broker, so the error is `Unavailable`
    /// (retried by the caller: a duplicate, never a loss).
    #[allow(clippy::too_many_arguments)]
    async fn publish_attempts(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
        mut alone: bool,
        deadline: Instant,
    ) -> Result<()> {
        check_name(exchange)?;
        check_key(routing_key)?;
        loop {
            let link = self.link(Some(deadline)).await?;
            let attempt = Self::publish_on(
                &link,
                exchange,
                routing_key,
                body,
                options,
                properties,
                alone,
            );
            let Ok(outcome) = tokio::time::timeout_at(deadline, attempt).await else {
                return Err(self.timed_out());
            };
            // Not under the deadline: judging a 404 asks the broker on the shared topology
            // channel, whose calls amqprs cannot have cut off (a dropped call leaves its
            // reply to the next caller of the same kind).
            match self.judge(&link, exchange, routing_key, outcome).await {
                Judged::Done(result) => return result,
                Judged::Refused(refusal) if alone => return Err(refusal),
                Judged::Refused(_) => alone = true,
                Judged::Retry(reason) => {
                    if self.is_closed() {
                        return Err(BusError::Closed);
                    }
                    if Instant::now() >= deadline {
                        return Err(BusError::Unavailable(format!(
                            "publish not confirmed: {reason}"
                        )));
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// The error of a publish whose deadline passed while the broker had not answered it.
    fn timed_out(&self) -> BusError {
        BusError::Unavailable(format!(
            "publish not confirmed within {:?} (the broker neither confirmed nor refused it)",
            self.options.operation_timeout
        ))
    }

    /// Turns the outcome of one publish attempt into a result or a retry.
    async fn judge(
        &self,
        link: &Link,
        exchange: &str,
        routing_key: &str,
        outcome: std::result::Result<Confirmation, AmqpError>,
    ) -> Judged {
        match outcome {
            Ok(Confirmation::Ack { returned: false }) => Judged::Done(Ok(())),
            Ok(Confirmation::Ack { returned: true }) => Judged::Done(Err(BusError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Ok(Confirmation::Nack) => Judged::Done(Err(BusError::Rejected {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Err(error) => match classify(&error) {
                // A 404 closes the whole publish channel, failing every publish in flight on
                // it: only the one whose exchange is really missing gets the error.
                Failure::Final(BusError::NotFound(text)) => {
                    match self.exchange_exists(link, exchange).await {
                        Some(false) => Judged::Done(Err(BusError::NotFound(text))),
                        _ => Judged::Retry(error.to_string()),
                    }
                }
                // Any other refusal closed the channel for every publish in flight on it too;
                // a publish is not a declaration, whatever the reply code says.
                Failure::Final(BusError::DeclarationConflict { reason, .. })
                    if matches!(error, AmqpError::Refused { .. }) =>
                {
                    Judged::Refused(BusError::InvalidArgument(reason))
                }
                Failure::Final(e) if matches!(error, AmqpError::Refused { .. }) => {
                    Judged::Refused(e)
                }
                Failure::Final(e) => Judged::Done(Err(e)),
                Failure::Connection => {
                    self.report_broken(link.generation);
                    Judged::Retry(error.to_string())
                }
                Failure::Channel => {
                    if !link.connection.is_open() {
                        self.report_broken(link.generation);
                    }
                    Judged::Retry(error.to_string())
                }
            },
        }
    }

    /// `Some(exists)` from a passive declare; `None` if the broker could not tell.
    async fn exchange_exists(&self, link: &Link, exchange: &str) -> Option<bool> {
        if exchange.is_empty() {
            return Some(true);
        }
        let result = link
            .topology_op(|ch| async move {
                let passive = ExchangeDeclareArguments::new(exchange, "direct")
                    .passive(true)
                    .finish();
                ch.call(ch.channel.exchange_declare(passive)).await
            })
            .await;
        match result {
            Ok(()) => Some(true),
            Err(e) => match classify(&e) {
                Failure::Final(BusError::NotFound(_)) => Some(false),
                _ => None,
            },
        }
    }

    /// Publishes a batch; see [`Bus::publish_batch`](crate::bus::Bus::publish_batch).
    pub(super) async fn publish_batch(
        &self,
        messages: Vec<Outgoing>,
    ) -> Result<(), BatchPublishError> {
        let total = messages.len();
        if total == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + self.options.operation_timeout;
        let link = match self.link(Some(deadline)).await {
            Ok(link) => link,
            Err(e) => {
                let text = e.to_string();
                let closed = matches!(e, BusError::Closed);
                return Err(BatchPublishError::all(total, || {
                    if closed {
                        BusError::Closed
                    } else {
                        BusError::Unavailable(text.clone())
                    }
                }));
            }
        };
        // Send everything, then await every confirm: one round trip for the batch. Unconfirmed
        // messages go on the best-effort channel and are done once sent. The publish channel
        // is held while the batch is written (see `Link::publisher`). The deadline bounds the
        // writes and the confirms (see `publish_attempts`): past it, every message counts as
        // failed, even one whose confirm came (a duplicate if it is published again, never a
        // loss).
        let sent = async {
            let confirm_channel = link.publisher().await;
            let best_effort_channel = link.best_effort_publisher().await;
            let mut pending = Vec::with_capacity(total);
            for message in &messages {
                let route = if message.options.confirmed() {
                    confirm_channel
                        .as_ref()
                        .map(|publisher| Route::Confirmed(&publisher.0, &publisher.1))
                } else {
                    best_effort_channel.as_ref().map(Route::BestEffort)
                };
                let sent = match (
                    route,
                    check_name(&message.exchange).and(check_key(&message.routing_key)),
                ) {
                    (_, Err(invalid)) => Err(Err(invalid)),
                    (Err(e), _) => Err(Ok(e.clone())),
                    (Ok(route), Ok(())) => route
                        .write(
                            &message.exchange,
                            &message.routing_key,
                            &message.body,
                            message.options,
                            properties(message.options),
                        )
                        .await
                        .map_err(Ok),
                };
                pending.push(sent);
            }
            drop(confirm_channel);
            join_all(pending.into_iter().map(|sent| async move {
                match sent {
                    Ok(sent) => Ok(sent.confirmation().await),
                    Err(e) => Err(e),
                }
            }))
            .await
        };
        let Ok(confirms) = tokio::time::timeout_at(deadline, sent).await else {
            return Err(BatchPublishError::all(total, || self.timed_out()));
        };
        let mut failed = Vec::new();
        for (index, (message, confirm)) in messages.iter().zip(confirms).enumerate() {
            // Judged outside the deadline (see `publish_attempts`); a message published again
            // is bounded by it.
            let outcome = match confirm {
                Err(Err(invalid)) => Judged::Done(Err(invalid)),
                Err(Ok(send_error)) => {
                    self.judge(
                        &link,
                        &message.exchange,
                        &message.routing_key,
                        Err(send_error),
                    )
                    .await
                }
                Ok(confirmation) => {
                    self.judge(&link, &message.exchange, &message.routing_key, confirmation)
                        .await
                }
            };
            let message_properties = properties(message.options);
            let again = |alone| {
                self.publish_attempts(
                    &message.exchange,
                    &message.routing_key,
                    &message.body,
                    message.options,
                    &message_properties,
                    alone,
                    deadline,
                )
            };
            let result = match outcome {
                Judged::Done(result) => result,
                // Lost with the connection or channel: publish it again on its own.
                Judged::Retry(_) => again(false).await,
                // Refused on the shared channel: this message's refusal only if the
                // broker refuses it alone.
                Judged::Refused(_) => again(message.options.confirmed()).await,
            };
            if let Err(e) = result {
                failed.push((index, e));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(BatchPublishError { total, failed })
        }
    }
}

/// The channel a message goes on: the publish channel with its confirms when the message's
/// options ask for a confirm, else the best-effort channel.
enum Route<'c> {
    Confirmed(&'c Chan, &'c Confirms),
    BestEffort(&'c Chan),
}

impl Route<'_> {
    /// Writes one message on this channel.
    async fn write(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: BasicProperties,
    ) -> std::result::Result<Sent, AmqpError> {
        match *self {
            Route::Confirmed(chan, confirms) => {
                // Booked before the write, so the callback finds the number however soon
                // the broker's answer comes; given back unless the write completes. A
                // mandatory message is booked with its content's fingerprint, by which the
                // book pairs its return, if the broker returns it, with its ack.
                let returnable = options
                    .mandatory
                    .then(|| fingerprint(exchange, routing_key, body));
                let (number, answered) = confirms.book(returnable)?;
                let booking = Booking {
                    confirms,
                    number,
                    written: false,
                };
                write_on(chan, exchange, routing_key, body, options, properties).await?;
                booking.written();
                Ok(Sent::Confirming(Pending {
                    chan: chan.clone(),
                    answered,
                }))
            }
            Route::BestEffort(chan) => {
                write_on(chan, exchange, routing_key, body, options, properties).await?;
                Ok(Sent::Written)
            }
        }
    }
}

/// A confirm number booked for a message being written. Unless [`written`](Self::written)
/// is called, dropping it abandons the number ([`Confirms::abandon`]): the write failed, or
/// its future was dropped before completing (the publish deadline passed, the publisher was
/// cancelled). Either way the frame did not reach the connection's writer — amqprs hands the
/// whole message to it in one cancel-safe channel send, the write's only await — so the
/// channel did not number it, and the book must not count it either: else every later
/// message would be answered with its predecessor's confirm.
struct Booking<'c> {
    confirms: &'c Confirms,
    number: u64,
    written: bool,
}

impl Booking<'_> {
    /// The message was handed to the connection: its number stays booked.
    fn written(mut self) {
        self.written = true;
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        if !self.written {
            self.confirms.abandon(self.number);
        }
    }
}

/// Writes one message on `chan` (`basic.publish`, mandatory as `options` says).
async fn write_on(
    chan: &Chan,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    options: PublishOptions,
    properties: BasicProperties,
) -> std::result::Result<(), AmqpError> {
    let arguments = BasicPublishArguments::new(exchange, routing_key)
        .mandatory(options.mandatory)
        .finish();
    chan.call(
        chan.channel
            .basic_publish(properties, body.to_vec(), arguments),
    )
    .await
}

/// A message written on its channel.
enum Sent {
    /// Awaiting the broker's confirm.
    Confirming(Pending),
    /// Best effort: done once written (the broker sends nothing back).
    Written,
}

impl Sent {
    /// The broker's answer; a best-effort message's silence counts as an ack.
    async fn confirmation(self) -> std::result::Result<Confirmation, AmqpError> {
        match self {
            Sent::Confirming(pending) => pending.confirmed().await,
            Sent::Written => Ok(Confirmation::Ack { returned: false }),
        }
    }
}

/// A written message awaiting its confirmation.
struct Pending {
    /// The channel it was written on: why it closed, if it did.
    chan: Chan,
    /// The broker's answer, an ack `returned` exactly when this message was returned.
    answered: oneshot::Receiver<Confirmation>,
}

impl Pending {
    /// The broker's answer; an error when the channel closed before the answer came.
    async fn confirmed(self) -> std::result::Result<Confirmation, AmqpError> {
        self.answered.await.map_err(|_| {
            // The broker's reply if it closed the channel (a publish to a missing exchange
            // closes it for every message in flight on it), else a lost channel.
            self.chan.error(&amqprs::error::Error::InternalChannelError(
                "the publish channel closed before the confirm".into(),
            ))
        })
    }
}

/// What [`Inner::judge`] made of one publish attempt.
enum Judged {
    Done(Result<()>),
    Retry(String),
    /// The broker refused a publish on the channel and closed it: the refusal is the
    /// message's own only if the broker refuses it alone (see the module docs).
    Refused(BusError),
}
