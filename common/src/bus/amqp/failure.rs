//! What a failed broker call means for the caller: wait for a new connection, retry on a
//! fresh channel, or give the broker's definitive answer as a [`BusError`].
//!
//! RabbitMQ reports most refusals by closing the channel (`404`, `406`, `405`) or the whole
//! connection (hard errors). amqprs hands the reply of a closed channel to the channel's
//! callback and fails the call that was waiting with a bare "channel closed"; the link's
//! channels record that reply (`link::Chan`), so a failed call becomes an [`AmqpError`]
//! that knows why. Every retry loop of this backend (`Inner::retrying`, publishing,
//! consuming, dead letters) decides through [`classify`], so they all agree on which errors
//! are transient.

use std::fmt;

use crate::bus::BusError;

/// A failed broker call, as this backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum AmqpError {
    /// The broker closed the channel (or the connection) with this reply.
    Refused {
        /// The AMQP reply code (`404`, `406`, `320`, …).
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The channel is closed, by an error of another operation or by its own closing.
    ChannelClosed(String),
    /// The connection is gone.
    ConnectionLost(String),
    /// Anything else the client reported.
    Client(String),
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused { code, text } => write!(f, "the broker refused ({code}): {text}"),
            Self::ChannelClosed(text) => write!(f, "channel closed: {text}"),
            Self::ConnectionLost(text) => write!(f, "connection lost: {text}"),
            Self::Client(text) => write!(f, "AMQP client error: {text}"),
        }
    }
}

/// What to do with a failed broker call.
pub(super) enum Failure {
    /// The connection is gone: wait for the next link and retry.
    Connection,
    /// The channel was closed (by an error of another operation, or while closing): retry on
    /// a fresh channel.
    Channel,
    /// A definitive answer from the broker.
    Final(BusError),
}

/// AMQP 0-9-1 reply codes this backend tells apart.
const CONNECTION_FORCED: u16 = 320;
const ACCESS_REFUSED: u16 = 403;
const NOT_FOUND: u16 = 404;
const RESOURCE_LOCKED: u16 = 405;
const PRECONDITION_FAILED: u16 = 406;

pub(super) fn classify(error: &AmqpError) -> Failure {
    match error {
        AmqpError::Refused { code, text } => match *code {
            NOT_FOUND => not_found(text.clone()),
            PRECONDITION_FAILED => Failure::Final(BusError::DeclarationConflict {
                name: extract_name(text),
                reason: text.clone(),
            }),
            RESOURCE_LOCKED => Failure::Final(BusError::Locked(extract_name(text))),
            ACCESS_REFUSED => Failure::Final(BusError::InvalidArgument(text.clone())),
            // The hard errors (`320` and the 5xx codes) close the connection.
            CONNECTION_FORCED | 500.. => Failure::Connection,
            _ => Failure::Final(BusError::Internal(text.clone())),
        },
        AmqpError::ChannelClosed(_) => Failure::Channel,
        AmqpError::ConnectionLost(_) => Failure::Connection,
        AmqpError::Client(text) => Failure::Final(BusError::Internal(text.clone())),
    }
}

/// A `404` from RabbitMQ: final, unless it names a queue whose home node "is down or
/// inaccessible" — what a quorum queue answers while its replicas are still starting (another
/// process declaring the same queue a moment earlier), so a fresh channel retries it until
/// the operation's deadline.
fn not_found(text: String) -> Failure {
    if text.contains("is down or inaccessible") {
        Failure::Channel
    } else {
        Failure::Final(BusError::NotFound(text))
    }
}

/// Pulls the object name out of a RabbitMQ reply text (`… for queue 'x' in vhost '/'`).
fn extract_name(text: &str) -> String {
    for marker in ["queue '", "exchange '"] {
        if let Some(start) = text.find(marker) {
            let rest = &text[start + marker.len()..];
            if let Some(end) = rest.find('\'') {
                return rest[..end].to_owned();
            }
        }
    }
    text.split('\'').nth(1).unwrap_or(text).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_still_starting_is_retried_and_a_missing_one_is_not() {
        let starting = "NOT_FOUND - home node 'rabbit@localhost' of durable queue \
                        'a.events.0' in vhost '/' is down or inaccessible";
        assert!(matches!(not_found(starting.into()), Failure::Channel));
        let missing = "NOT_FOUND - no queue 'a.events.0' in vhost '/'";
        assert!(matches!(
            not_found(missing.into()),
            Failure::Final(BusError::NotFound(text)) if text == missing
        ));
    }

    #[test]
    fn reply_codes_decide_between_final_answers_and_a_lost_connection() {
        let refused = |code| AmqpError::Refused {
            code,
            text: format!("{code} - for queue 'q' in vhost '/'"),
        };
        assert!(matches!(
            classify(&refused(406)),
            Failure::Final(BusError::DeclarationConflict { name, .. }) if name == "q"
        ));
        assert!(matches!(
            classify(&refused(405)),
            Failure::Final(BusError::Locked(name)) if name == "q"
        ));
        assert!(matches!(classify(&refused(320)), Failure::Connection));
        assert!(matches!(classify(&refused(541)), Failure::Connection));
        assert!(matches!(
            classify(&AmqpError::ChannelClosed("x".into())),
            Failure::Channel
        ));
    }

    #[test]
    fn names_are_extracted_from_reply_texts() {
        assert_eq!(
            extract_name(
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q1' in vhost '/'"
            ),
            "q1"
        );
        assert_eq!(
            extract_name(
                "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'gw' in vhost '/'"
            ),
            "gw"
        );
        assert_eq!(extract_name("no quotes"), "no quotes");
    }
}
