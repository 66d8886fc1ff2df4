//! What a failed broker call means for the caller: wait for a new connection, retry on a
//! fresh channel, or give the broker's definitive answer as a [`BusError`].
//!
//! RabbitMQ reports most refusals by closing the channel (`404`, `406`, `405`) or the whole
//! connection (hard errors); lapin surfaces both, and its own I/O failures, as one
//! `lapin::Error`. Every retry loop of this backend (`Inner::retrying`, publishing,
//! consuming, dead letters) decides through [`classify`], so they all agree on which errors
//! are transient.

use lapin::ErrorKind;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};

use crate::bus::BusError;

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

pub(super) fn classify(error: &lapin::Error) -> Failure {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => {
                let text = amqp.get_message().as_str().to_owned();
                Failure::Final(match soft {
                    AMQPSoftError::NOTFOUND => return not_found(text),
                    AMQPSoftError::PRECONDITIONFAILED => BusError::DeclarationConflict {
                        name: extract_name(&text),
                        reason: text,
                    },
                    AMQPSoftError::RESOURCELOCKED => BusError::Locked(extract_name(&text)),
                    AMQPSoftError::ACCESSREFUSED => BusError::InvalidArgument(text),
                    _ => BusError::Internal(text),
                })
            }
            AMQPErrorKind::Hard(_) => Failure::Connection,
        },
        ErrorKind::IOError(_)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::MissingHeartbeatError => Failure::Connection,
        ErrorKind::InvalidChannel(_) | ErrorKind::InvalidChannelState(..) => Failure::Channel,
        _ => Failure::Final(BusError::Internal(error.to_string())),
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
