//! Publisher confirms that tell each publisher whether *its own* message was returned.
//!
//! A channel in confirm mode numbers the messages published on it 1, 2, 3, … in the order
//! they reach the broker, and the broker acks (or nacks) them by that number, several at once
//! with `multiple`. The link writes a message and books its number under one lock (the
//! publish channel's), so [`Confirms`] knows which publisher waits for which number.
//!
//! RabbitMQ answers an unroutable `mandatory` message with `basic.return` before the
//! message's ack, and amqprs calls the channel's callback for each frame in the order they
//! came. A return carries no number, only the message's content, so it is pooled by a
//! fingerprint of that content (exchange, routing key, body) and paired when an ack comes:
//! every message that ack answers and that was booked with the same fingerprint takes one
//! such return, in number order. A message's return always came before its ack, so it is in
//! the pool by then; a return not yet paired belongs to a message not yet acked, so the pool
//! never holds more returns than mandatory messages wait (one beyond that has no possible
//! owner, and is dropped). Two messages of equal content (and equal properties, which
//! Switchboard derives from its options) are interchangeable: whichever takes the return,
//! the counts of delivered and returned messages are right.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::failure::AmqpError;

/// The broker's answer to one confirmed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirmation {
    /// Taken by the broker; `returned` when it matched no binding (a `mandatory` message).
    Ack { returned: bool },
    /// Refused by the broker (`basic.nack`).
    Nack,
}

/// The fingerprint of a message's content by which its return is recognized.
pub(super) fn fingerprint(exchange: &str, routing_key: &str, body: &[u8]) -> u64 {
    // `DefaultHasher::new` hashes alike in every instance: the same on both sides of the
    // pairing.
    let mut hasher = std::hash::DefaultHasher::new();
    exchange.hash(&mut hasher);
    routing_key.hash(&mut hasher);
    body.hash(&mut hasher);
    hasher.finish()
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
    waiting: BTreeMap<u64, Waiter>,
    /// Returns whose message's ack has not come yet: how many of each fingerprint.
    returns: HashMap<u64, usize>,
    /// The returns in `returns`, all fingerprints together.
    returns_pooled: usize,
    /// The messages in `waiting` that may be returned: no more returns can be pooled.
    returnable_waiting: usize,
    /// The channel is closed: nothing written on it will be confirmed any more.
    closed: bool,
}

impl Book {
    /// A mandatory message of this fingerprint was answered (it no longer waits): takes a
    /// pooled return of its content if there is one (then it was returned).
    fn take_return(&mut self, fingerprint: u64) -> bool {
        self.returnable_waiting -= 1;
        let Some(count) = self.returns.get_mut(&fingerprint) else {
            return false;
        };
        *count -= 1;
        if *count == 0 {
            self.returns.remove(&fingerprint);
        }
        self.returns_pooled -= 1;
        true
    }
}

/// A message waiting for its confirm.
struct Waiter {
    /// Where the broker's answer goes.
    answer: oneshot::Sender<Confirmation>,
    /// Its content's fingerprint when it may be returned (`mandatory`).
    returnable: Option<u64>,
}

impl Confirms {
    /// The book of a channel about to be put in confirm mode.
    pub(super) fn new() -> Self {
        Self(Arc::new(Mutex::new(Book {
            next: 1,
            waiting: BTreeMap::new(),
            returns: HashMap::new(),
            returns_pooled: 0,
            returnable_waiting: 0,
            closed: false,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Books the next number of the channel for a message about to be written (the caller
    /// holds the channel's publish lock until it is written, or [`abandon`](Self::abandon)s
    /// it), and returns the number and where the broker's answer will come. `returnable`:
    /// the message's [`fingerprint`] if it is `mandatory` (the broker may return it).
    pub(super) fn book(
        &self,
        returnable: Option<u64>,
    ) -> Result<(u64, oneshot::Receiver<Confirmation>), AmqpError> {
        let (answer, answered) = oneshot::channel();
        let mut book = self.lock();
        if book.closed {
            return Err(AmqpError::ChannelClosed(
                "the publish channel is closed".into(),
            ));
        }
        let number = book.next;
        book.next += 1;
        book.returnable_waiting += usize::from(returnable.is_some());
        book.waiting.insert(number, Waiter { answer, returnable });
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
            let waiter = book.waiting.remove(&number);
            if waiter.is_some_and(|w| w.returnable.is_some()) {
                book.returnable_waiting -= 1;
            }
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
    /// `ack`, or refused it. Each acked message that may be returned takes a pooled return
    /// of its content, if there is one (see the module docs).
    pub(super) fn acked(&self, number: u64, multiple: bool, ack: bool) {
        let answered: Vec<(oneshot::Sender<Confirmation>, Confirmation)> = {
            let mut book = self.lock();
            let waiters: Vec<Waiter> = if multiple {
                let later = book.waiting.split_off(&(number + 1));
                std::mem::replace(&mut book.waiting, later)
                    .into_values()
                    .collect()
            } else {
                book.waiting.remove(&number).into_iter().collect()
            };
            waiters
                .into_iter()
                .map(|waiter| {
                    let returned = waiter
                        .returnable
                        .is_some_and(|fingerprint| book.take_return(fingerprint));
                    let confirmation = if ack {
                        Confirmation::Ack { returned }
                    } else {
                        Confirmation::Nack
                    };
                    (waiter.answer, confirmation)
                })
                .collect()
        };
        for (answer, confirmation) in answered {
            let _ = answer.send(confirmation);
        }
    }

    /// The broker returned a message (its ack follows).
    pub(super) fn returned(&self, exchange: &str, routing_key: &str, body: &[u8]) {
        let fingerprint = fingerprint(exchange, routing_key, body);
        let mut book = self.lock();
        if book.returns_pooled >= book.returnable_waiting {
            // Every waiting mandatory message already has a return: this one is nobody's (a
            // message this book did not send, or one whose waiter is gone with a closed book).
            tracing::warn!("a returned message matches no message waiting for its confirm");
            return;
        }
        *book.returns.entry(fingerprint).or_default() += 1;
        book.returns_pooled += 1;
    }

    /// The channel closed: whoever still waits is answered with an error (dropping their
    /// senders), and later writes are refused.
    pub(super) fn channel_closed(&self) {
        let waiting = {
            let mut book = self.lock();
            book.closed = true;
            book.returns.clear();
            book.returns_pooled = 0;
            book.returnable_waiting = 0;
            std::mem::take(&mut book.waiting)
        };
        drop(waiting);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(confirms: &Confirms) -> oneshot::Receiver<Confirmation> {
        confirms.book(None).expect("open").1
    }

    const ACK: Confirmation = Confirmation::Ack { returned: false };
    const RETURNED: Confirmation = Confirmation::Ack { returned: true };

    #[test]
    fn a_multiple_ack_answers_every_message_up_to_its_number() {
        let confirms = Confirms::new();
        let mut answers: Vec<_> = (0..4).map(|_| waiter(&confirms)).collect();
        confirms.acked(3, true, true);
        for answer in &mut answers[..3] {
            assert_eq!(answer.try_recv(), Ok(ACK));
        }
        assert!(answers[3].try_recv().is_err(), "4 is not confirmed yet");
        confirms.acked(4, false, false);
        assert_eq!(answers[3].try_recv(), Ok(Confirmation::Nack));
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
            confirms.book(None).is_err(),
            "nothing is booked on a closed channel"
        );
    }

    #[test]
    fn a_message_not_written_gives_its_number_back() {
        let confirms = Confirms::new();
        let (first, _answer) = confirms.book(None).expect("open");
        let (second, _) = confirms.book(None).expect("open");
        confirms.abandon(second);
        assert_eq!(confirms.book(None).expect("open").0, first + 1);
        assert!(!confirms.is_closed());
    }

    #[test]
    fn a_number_abandoned_after_a_later_booking_closes_the_book() {
        let confirms = Confirms::new();
        let (first, mut first_answer) = confirms.book(None).expect("open");
        let (_second, mut second_answer) = confirms.book(None).expect("open");
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
        assert!(confirms.book(None).is_err());
    }

    #[test]
    fn a_return_goes_to_the_acked_message_of_its_content_only() {
        let confirms = Confirms::new();
        let book = |key: &str| {
            confirms
                .book(Some(fingerprint("ex", key, b"1")))
                .expect("open")
                .1
        };
        let (mut a, mut b, mut c) = (book("a"), book("b"), book("a"));
        // The broker returns the second message; its ack, with the first's, follows.
        confirms.returned("ex", "b", b"1");
        confirms.acked(2, true, true);
        assert_eq!(a.try_recv(), Ok(ACK));
        assert_eq!(b.try_recv(), Ok(RETURNED));
        // A return of equal content waiting for a later ack is that message's.
        confirms.returned("ex", "a", b"1");
        confirms.acked(3, false, true);
        assert_eq!(c.try_recv(), Ok(RETURNED));
    }

    #[test]
    fn returns_are_paired_at_any_volume_in_flight() {
        // More returned messages in flight than the old pool's bound (1,024): each is paired
        // with its own message however many wait (before, the oldest returns were dropped and
        // their messages reported as delivered).
        let confirms = Confirms::new();
        let n = 6_144;
        let mut answers: Vec<_> = (0..n)
            .map(|i| {
                let key = format!("k{}", i % 2);
                confirms
                    .book(Some(fingerprint("ex", &key, b"x")))
                    .expect("open")
                    .1
            })
            .collect();
        // Every message with key k1 is returned (in number order), then all are acked at once.
        for _ in 0..n / 2 {
            confirms.returned("ex", "k1", b"x");
        }
        confirms.acked(u64::try_from(n).unwrap(), true, true);
        for (i, answer) in answers.iter_mut().enumerate() {
            let expected = if i % 2 == 1 { RETURNED } else { ACK };
            assert_eq!(answer.try_recv(), Ok(expected), "message {i}");
        }
    }

    #[test]
    fn a_return_nobody_can_own_is_not_kept_for_a_later_message() {
        let confirms = Confirms::new();
        // No mandatory message waits: a return now is nobody's.
        confirms.returned("ex", "a", b"1");
        let mut later = confirms
            .book(Some(fingerprint("ex", "a", b"1")))
            .expect("open")
            .1;
        confirms.acked(1, false, true);
        assert_eq!(later.try_recv(), Ok(ACK));
    }

    #[test]
    fn a_message_that_cannot_be_returned_takes_no_return() {
        let confirms = Confirms::new();
        let mut plain = waiter(&confirms);
        confirms.returned("ex", "a", b"1");
        confirms.acked(1, false, true);
        assert_eq!(plain.try_recv(), Ok(ACK));
    }
}
