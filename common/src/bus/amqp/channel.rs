//! A channel of the link and what its callback learned.
//!
//! amqprs tells a channel's callback what the broker sends on its own (a channel closed with
//! a refusal, a consumer cancelled, publisher confirms and returns) and fails the call that
//! caused a refusal with a bare "channel closed". [`Chan`] keeps what the callback heard next
//! to the channel, so a failed call can say why ([`Chan::error`]), and passes the publish
//! channel's confirms and returns on to its [`Confirms`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use amqprs::callbacks::ChannelCallback;
use amqprs::channel::Channel;
use amqprs::connection::Connection;
use amqprs::{Ack, BasicProperties, Cancel, CloseChannel, Nack, Return};

use super::confirms::Confirms;
use super::failure::AmqpError;

/// What amqprs answers a call with.
pub(super) type ClientResult<T> = std::result::Result<T, amqprs::error::Error>;

/// A channel and what its callback learned: the broker's reply when it closed the channel
/// (amqprs fails the waiting call with a bare "channel closed" and hands the reply to the
/// callback only), and, on the publish channel, the confirms. Cheap to clone.
#[derive(Clone)]
pub(super) struct Chan {
    pub(super) channel: Channel,
    connection: Connection,
    closed: Arc<Mutex<Option<(u16, String)>>>,
    /// The broker cancelled a consumer of this channel (its queue was deleted).
    cancelled: Arc<AtomicBool>,
}

/// Whether a connection that just gave a channel number `id` of at most `max` must be
/// replaced before its numbers run out.
///
/// amqprs 2.1 frees a channel's number only when the client closes the channel; a channel
/// the broker closes (a refused publish, a passive declare of a missing exchange) keeps its
/// number for the connection's life. When every number is taken, amqprs panics in the
/// connection's reader task and the connection dies with whatever was in flight. amqprs gives
/// the lowest free number, so a high one means most numbers are held — by far more channels
/// than a Switchboard process keeps open (a few, plus one per subscription) — and the bus
/// then replaces the connection, as after any connection loss, while that is still a
/// planned step: at half the numbers.
pub(super) fn numbers_running_out(id: u16, max: u16) -> bool {
    // `max` 0 means "no limit" (65,535 numbers).
    let max = if max == 0 { u16::MAX } else { max };
    id > max / 2
}

impl Chan {
    /// Opens a channel on `connection`; its confirms, returns and acks go to `confirms`.
    pub(super) async fn open(
        connection: &Connection,
        confirms: Option<Confirms>,
    ) -> std::result::Result<Self, AmqpError> {
        let channel = connection
            .open_channel(None)
            .await
            .map_err(|e| connection_error(connection, &e))?;
        let id = channel.channel_id();
        if numbers_running_out(id, connection.channel_max()) {
            // In a task of its own: a caller's deadline must not cut the close off half way.
            tokio::spawn(async move {
                let _ = channel.close().await;
            });
            return Err(AmqpError::ConnectionLost(format!(
                "channel number {} of at most {}: the connection's channel numbers are running \
                 out (amqprs keeps the number of every channel the broker closed); reconnecting",
                id,
                connection.channel_max()
            )));
        }
        let closed = Arc::new(Mutex::new(None));
        let cancelled = Arc::new(AtomicBool::new(false));
        let chan = Self {
            channel,
            connection: connection.clone(),
            closed: closed.clone(),
            cancelled: cancelled.clone(),
        };
        let callbacks = Callbacks {
            closed,
            cancelled,
            confirms,
        };
        chan.call(chan.channel.register_callback(callbacks)).await?;
        Ok(chan)
    }

    /// Whether the channel can still be used.
    pub(super) fn is_open(&self) -> bool {
        self.channel.is_open()
    }

    /// Whether the broker cancelled a consumer of this channel (it does when the queue is
    /// deleted).
    pub(super) fn consumer_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Runs one call on this channel, its failure told apart (see [`AmqpError`]).
    pub(super) async fn call<T>(
        &self,
        call: impl Future<Output = ClientResult<T>>,
    ) -> std::result::Result<T, AmqpError> {
        call.await.map_err(|error| self.error(&error))
    }

    /// What a failed call on this channel means: the reply the broker closed it with, if it
    /// did, else whether the connection or only the channel is gone.
    pub(super) fn error(&self, error: &amqprs::error::Error) -> AmqpError {
        let closed = self
            .closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some((code, text)) = closed {
            return AmqpError::Refused { code, text };
        }
        if !self.connection.is_open() {
            return AmqpError::ConnectionLost(error.to_string());
        }
        match error {
            amqprs::error::Error::NetworkError(text) => AmqpError::ConnectionLost(text.clone()),
            amqprs::error::Error::InternalChannelError(text)
            | amqprs::error::Error::ChannelUseError(text)
            | amqprs::error::Error::ChannelCloseError(text)
            | amqprs::error::Error::ChannelOpenError(text) => {
                AmqpError::ChannelClosed(text.clone())
            }
            other => AmqpError::Client(other.to_string()),
        }
    }

    /// Closes the channel (its unsettled deliveries go back to their queue).
    pub(super) async fn close(self) {
        let _ = self.channel.close().await;
    }
}

/// A failure to open a channel: the connection is gone, or the client refused.
fn connection_error(connection: &Connection, error: &amqprs::error::Error) -> AmqpError {
    if connection.is_open() {
        AmqpError::Client(error.to_string())
    } else {
        AmqpError::ConnectionLost(error.to_string())
    }
}

/// The callback of every channel of the link: records the reply of a broker-closed channel
/// and passes the publish channel's confirms and returns to its [`Confirms`] (amqprs calls
/// these in the order the frames came, so a message's return is seen before its ack).
struct Callbacks {
    closed: Arc<Mutex<Option<(u16, String)>>>,
    cancelled: Arc<AtomicBool>,
    confirms: Option<Confirms>,
}

impl Drop for Callbacks {
    /// The channel's dispatcher ended (the channel or its connection is gone): no confirm
    /// will come any more.
    fn drop(&mut self) {
        if let Some(confirms) = &self.confirms {
            confirms.channel_closed();
        }
    }
}

#[async_trait::async_trait]
impl ChannelCallback for Callbacks {
    async fn close(&mut self, channel: &Channel, close: CloseChannel) -> ClientResult<()> {
        tracing::debug!(channel = %channel, code = close.reply_code(), text = %close.reply_text(), "the broker closed a channel");
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((close.reply_code(), close.reply_text().to_owned()));
        if let Some(confirms) = &self.confirms {
            confirms.channel_closed();
        }
        Ok(())
    }

    async fn cancel(&mut self, _channel: &Channel, _cancel: Cancel) -> ClientResult<()> {
        // The consumer's receiver ends; the subscription's task reads this to tell a deleted
        // queue from a lost channel.
        self.cancelled.store(true, Ordering::Release);
        Ok(())
    }

    async fn flow(&mut self, _channel: &Channel, active: bool) -> ClientResult<bool> {
        Ok(active)
    }

    async fn publish_ack(&mut self, _channel: &Channel, ack: Ack) {
        if let Some(confirms) = &self.confirms {
            confirms.acked(ack.delivery_tag(), ack.mutiple(), true);
        }
    }

    async fn publish_nack(&mut self, _channel: &Channel, nack: Nack) {
        if let Some(confirms) = &self.confirms {
            confirms.acked(nack.delivery_tag(), nack.multiple(), false);
        }
    }

    async fn publish_return(
        &mut self,
        _channel: &Channel,
        ret: Return,
        _properties: BasicProperties,
        content: Vec<u8>,
    ) {
        if let Some(confirms) = &self.confirms {
            confirms.returned(ret.exchange(), ret.routing_key(), &content);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::numbers_running_out;

    #[test]
    fn a_connection_is_replaced_at_half_its_channel_numbers() {
        assert!(!numbers_running_out(1, 2047));
        assert!(!numbers_running_out(1023, 2047));
        assert!(numbers_running_out(1024, 2047));
        assert!(!numbers_running_out(32_767, 0), "0: no limit");
        assert!(numbers_running_out(32_768, 0));
    }
}
