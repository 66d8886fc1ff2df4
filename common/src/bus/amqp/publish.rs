//! Publishing: confirmed (persistent, mandatory, awaited until the broker's ack) and best
//! effort (written on the channel without confirms), one at a time or as a batch.
//!
//! One attempt is sent on the link's channel for its options; [`Inner::judge`] turns its
//! outcome into a result or a retry (a lost connection or a channel closed by someone else's
//! error), and retries publish again until the operation timeout — so a message may be
//! duplicated, never silently lost. A batch sends everything and then awaits every confirm,
//! and only the messages whose outcome was lost are published again, one by one.

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions};
use lapin::publisher_confirm::Confirmation;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use tokio::time::Instant;

use super::confirms::{Confirms, Pending};
use super::failure::{Failure, classify};
use super::link::{Inner, Link, RETRY_PAUSE};
use super::properties::properties;
use crate::bus::{
    BatchPublishError, BusError, Outgoing, PublishOptions, Result, check_key, check_name,
};

impl Inner {
    /// One publish attempt on `link`: send, then await the confirm (unless `options` asks
    /// for none: then the broker's silence is taken as an ack).
    async fn publish_on(
        link: &Link,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        options: PublishOptions,
        properties: &BasicProperties,
    ) -> std::result::Result<Confirmation, lapin::Error> {
        let (publisher, best_effort);
        let route = if options.confirmed() {
            publisher = link.publisher().await?;
            Route::Confirmed(&publisher.0, &publisher.1)
        } else {
            best_effort = link.best_effort_publisher().await?;
            Route::BestEffort(&best_effort)
        };
        route
            .write(exchange, routing_key, body, options, properties.clone())
            .await?
            .confirmation()
            .await
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
        check_name(exchange)?;
        check_key(routing_key)?;
        let deadline = Instant::now() + self.options.operation_timeout;
        loop {
            let link = self.link(Some(deadline)).await?;
            let outcome =
                Self::publish_on(&link, exchange, routing_key, body, options, properties).await;
            match self.judge(&link, exchange, routing_key, outcome).await {
                Judged::Done(result) => return result,
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

    /// Turns the outcome of one publish attempt into a result or a retry.
    async fn judge(
        &self,
        link: &Link,
        exchange: &str,
        routing_key: &str,
        outcome: std::result::Result<Confirmation, lapin::Error>,
    ) -> Judged {
        match outcome {
            Ok(Confirmation::Ack(None)) => Judged::Done(Ok(())),
            Ok(Confirmation::Ack(Some(_returned))) => Judged::Done(Err(BusError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Ok(Confirmation::Nack(_)) => Judged::Done(Err(BusError::Rejected {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            })),
            Ok(Confirmation::NotRequested) => Judged::Done(Err(BusError::Internal(
                "publisher confirms are not enabled on the channel".into(),
            ))),
            Err(error) => match classify(&error) {
                // A 404 closes the whole publish channel, failing every publish in flight on
                // it: only the one whose exchange is really missing gets the error.
                Failure::Final(BusError::NotFound(text)) => {
                    match self.exchange_exists(link, exchange).await {
                        Some(false) => Judged::Done(Err(BusError::NotFound(text))),
                        _ => Judged::Retry(error.to_string()),
                    }
                }
                Failure::Final(e) => Judged::Done(Err(e)),
                Failure::Connection => {
                    self.report_broken(link.generation);
                    Judged::Retry(error.to_string())
                }
                Failure::Channel => {
                    if !link.connection.status().connected() {
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
                ch.exchange_declare(
                    exchange,
                    lapin::ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
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
        // messages go on the best-effort channel and are done once sent.
        let confirm_channel = link.publisher().await;
        let best_effort_channel = link.best_effort_publisher().await;
        let mut pending = Vec::with_capacity(total);
        for message in &messages {
            let route = if message.options.confirmed() {
                confirm_channel
                    .as_ref()
                    .map(|(channel, confirms)| Route::Confirmed(channel, confirms))
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
        let confirms = join_all(pending.into_iter().map(|sent| async move {
            match sent {
                Ok(sent) => Ok(sent.confirmation().await),
                Err(e) => Err(e),
            }
        }))
        .await;
        let mut failed = Vec::new();
        for (index, (message, confirm)) in messages.iter().zip(confirms).enumerate() {
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
            let result = match outcome {
                Judged::Done(result) => result,
                // Lost with the connection or channel: publish it again on its own.
                Judged::Retry(_) => {
                    self.publish(
                        &message.exchange,
                        &message.routing_key,
                        &message.body,
                        message.options,
                    )
                    .await
                }
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
    Confirmed(&'c Channel, &'c Confirms),
    BestEffort(&'c Channel),
}

impl Route<'_> {
    /// Writes one message on this channel.
    async fn write<'a>(
        &self,
        exchange: &'a str,
        routing_key: &'a str,
        body: &'a [u8],
        options: PublishOptions,
        properties: BasicProperties,
    ) -> std::result::Result<Sent<'a>, lapin::Error> {
        let publish_options = BasicPublishOptions {
            mandatory: options.mandatory,
            immediate: false,
        };
        match *self {
            Route::Confirmed(channel, confirms) => confirms
                .send(
                    channel,
                    exchange,
                    routing_key,
                    body,
                    publish_options,
                    properties,
                )
                .await
                .map(Sent::Confirming),
            Route::BestEffort(channel) => {
                channel
                    .basic_publish(exchange, routing_key, publish_options, body, properties)
                    .await?;
                Ok(Sent::Written)
            }
        }
    }
}

/// A message written on its channel.
enum Sent<'a> {
    /// Awaiting the broker's confirm.
    Confirming(Pending<'a>),
    /// Best effort: done once written (the broker sends nothing back).
    Written,
}

impl Sent<'_> {
    /// The broker's answer; a best-effort message's silence counts as an ack.
    async fn confirmation(self) -> std::result::Result<Confirmation, lapin::Error> {
        match self {
            Sent::Confirming(pending) => pending.confirmed().await,
            Sent::Written => Ok(Confirmation::Ack(None)),
        }
    }
}

/// What [`Inner::judge`] made of one publish attempt.
enum Judged {
    Done(Result<()>),
    Retry(String),
}
