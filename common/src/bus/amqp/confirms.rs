//! Publisher confirms that tell each publisher whether *its own* message was returned.
//!
//! A channel in confirm mode numbers the messages published on it 1, 2, 3, … in the order
//! they reach the broker, and the broker acks (or nacks) them by that number, several at once
//! with `multiple`. The link writes a message and books its number under one lock (the
//! publish channel's), so [`Confirms`] knows which publisher waits for which number.
//!
//! RabbitMQ answers an unroutable `mandatory` message with `basic.return` before the
//! message's ack, and amqprs calls the channel's callback for each frame in the order they
//! came. A return carries no number, so it is pooled, and the owner claims it by its message's
//! content (exchange, routing key, body) once its ack came: by then the return is in the pool.
//! Two messages of equal content are interchangeable: whichever claims the return, the counts
//! of delivered and returned messages are right.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::failure::AmqpError;

/// Returns nobody claimed (their publisher gave up waiting) are kept up to this many, oldest
/// dropped first, so a stray return cannot grow the pool without bound.
const MAX_UNCLAIMED_RETURNS: usize = 1024;

/// The broker's answer to one confirmed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirmation {
    /// Taken by the broker; `returned` when it matched no binding (a `mandatory` message).
    Ack { returned: bool },
    /// Refused by the broker (`basic.nack`).
    Nack,
}

/// The confirm bookkeeping of one publish channel; cheap to clone. The channel's callback
/// answers it ([`acked`](Self::acked), [`returned`](Self::returned),
/// [`channel_closed`](Self::channel_closed)).
#[derive(Clone)]
pub(super) struct Confirms(Arc<Mutex<Book>>);

struct Book {
    /// The number the channel gives the next message published on it.
    next: u64,
    /// Messages written and not yet confirmed, by number.
    /// Each waiter is told whether the broker acked (`true`) or nacked its message.
    waiting: BTreeMap<u64, oneshot::Sender<bool>>,
    /// Returns taken in, waiting for their owner to claim them.
    returns: VecDeque<Returned>,
    /// The channel is closed: nothing written on it will be confirmed any more.
    closed: bool,
}

/// A returned message, as its owner recognizes it.
struct Returned {
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
}

impl Confirms {
    /// The book of a channel about to be put in confirm mode.
    pub(super) fn new() -> Self {
        Self(Arc::new(Mutex::new(Book {
            next: 1,
            waiting: BTreeMap::new(),
            returns: VecDeque::new(),
            closed: false,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Books the next number of the channel for a message about to be written (the caller
    /// holds the channel's publish lock until it is written, or [`abandon`](Self::abandon)s
    /// it), and returns the number and where the broker's answer will come (`true`: acked).
    pub(super) fn book(&self) -> Result<(u64, oneshot::Receiver<bool>), AmqpError> {
        let (answer, answered) = oneshot::channel();
        let mut book = self.lock();
        if book.closed {
            return Err(AmqpError::ChannelClosed(
                "the publish channel is closed".into(),
            ));
        }
        let number = book.next;
        book.next += 1;
        book.waiting.insert(number, answer);
        Ok((number, answered))
    }

    /// The message booked as `number` was not written: its write failed (the channel is
    /// gone), or its future was dropped before the frame reached the connection's writer (a
    /// timeout, a cancelled publisher), so the channel did not number it. Its number is
    /// given back when it is the last one booked. When a later message was booked meanwhile
    /// (possible only if the publish lock was released before the booking was given back),
    /// the book can no longer tell which number the broker gives to which message: it
    /// closes as if the channel had (every waiter fails and publishes again; the link then
    /// opens a fresh channel, see [`is_closed`](Self::is_closed)), rather than answer a
    /// message with another one's confirm.
    pub(super) fn abandon(&self, number: u64) {
        let mut book = self.lock();
        if book.next == number + 1 {
            book.waiting.remove(&number);
            book.next = number;
        } else {
            drop(book);
            self.channel_closed();
        }
    }

    /// Whether the book closed: its channel closed, or the book lost track of its numbers
    /// ([`abandon`](Self::abandon)). Nothing more may be published with it.
    pub(super) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The broker confirmed message `number` (and every earlier one, with `multiple`):
    /// `ack`, or refused it.
    pub(super) fn acked(&self, number: u64, multiple: bool, ack: bool) {
        let answered: Vec<_> = {
            let mut book = self.lock();
            if multiple {
                let later = book.waiting.split_off(&(number + 1));
                std::mem::replace(&mut book.waiting, later)
                    .into_values()
                    .collect()
            } else {
                book.waiting.remove(&number).into_iter().collect()
            }
        };
        for waiter in answered {
            let _ = waiter.send(ack);
        }
    }

    /// The broker returned a message (its ack follows).
    pub(super) fn returned(&self, exchange: &str, routing_key: &str, body: Vec<u8>) {
        let mut book = self.lock();
        book.returns.push_back(Returned {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            body,
        });
        while book.returns.len() > MAX_UNCLAIMED_RETURNS {
            book.returns.pop_front();
        }
    }

    /// The channel closed: whoever still waits is answered with an error (dropping their
    /// senders), and later writes are refused.
    pub(super) fn channel_closed(&self) {
        let waiting = {
            let mut book = self.lock();
            book.closed = true;
            std::mem::take(&mut book.waiting)
        };
        drop(waiting);
    }
}

impl Confirms {
    /// Takes the return of a message with this content out of the pool, if the broker
    /// returned one: called once the message's confirmation came, which the broker sends
    /// after its return.
    pub(super) fn claim_return(&self, exchange: &str, routing_key: &str, body: &[u8]) -> bool {
        let mut book = self.lock();
        let position = book
            .returns
            .iter()
            .position(|r| r.exchange == exchange && r.routing_key == routing_key && r.body == body);
        position.is_some_and(|p| book.returns.remove(p).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(confirms: &Confirms) -> oneshot::Receiver<bool> {
        confirms.book().expect("open").1
    }

    #[test]
    fn a_multiple_ack_answers_every_message_up_to_its_number() {
        let confirms = Confirms::new();
        let mut answers: Vec<_> = (0..4).map(|_| waiter(&confirms)).collect();
        confirms.acked(3, true, true);
        for answer in &mut answers[..3] {
            assert_eq!(answer.try_recv(), Ok(true));
        }
        assert!(answers[3].try_recv().is_err(), "4 is not confirmed yet");
        confirms.acked(4, false, false);
        assert_eq!(answers[3].try_recv(), Ok(false));
    }

    #[test]
    fn a_closed_channel_fails_every_waiting_message() {
        let confirms = Confirms::new();
        let mut answer = waiter(&confirms);
        confirms.channel_closed();
        assert!(matches!(
            answer.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        assert!(
            confirms.book().is_err(),
            "nothing is booked on a closed channel"
        );
    }

    #[test]
    fn a_message_not_written_gives_its_number_back() {
        let confirms = Confirms::new();
        let (first, _answer) = confirms.book().expect("open");
        let (second, _) = confirms.book().expect("open");
        confirms.abandon(second);
        assert_eq!(confirms.book().expect("open").0, first + 1);
        assert!(!confirms.is_closed());
    }

    #[test]
    fn a_number_abandoned_after_a_later_booking_closes_the_book() {
        let confirms = Confirms::new();
        let (first, mut first_answer) = confirms.book().expect("open");
        let (_second, mut second_answer) = confirms.book().expect("open");
        // The first message was not written after all, but the second was booked after it:
        // the broker would number the second 1, which the book has for the first.
        confirms.abandon(first);
        assert!(confirms.is_closed());
        for answer in [&mut first_answer, &mut second_answer] {
            assert!(matches!(
                answer.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            ));
        }
        assert!(confirms.book().is_err());
    }

    #[test]
    fn a_return_is_claimed_by_its_own_content_once() {
        let confirms = Confirms::new();
        confirms.returned("ex", "a", b"1".to_vec());
        assert!(!confirms.claim_return("ex", "b", b"1"));
        assert!(confirms.claim_return("ex", "a", b"1"));
        assert!(!confirms.claim_return("ex", "a", b"1"), "claimed once");
    }
}
