//! Publisher confirms that tell each publisher whether *its own* message was returned.
//!
//! RabbitMQ answers an unroutable `mandatory` message with `basic.return` followed by the
//! message's ack, but lapin hands a waiting return to whichever ack it reads next — and one
//! ack may cover several messages (`multiple`), or a later message's ack may come first. So
//! the return of message 3 can arrive on the confirmation of message 0 (or of another
//! publisher's message on the shared channel): the owner would be told "confirmed" while its
//! message was dropped, and an innocent one "unroutable".
//!
//! [`Confirms`] puts the pairing right. A driver task per publish channel holds every
//! outstanding confirmation, takes the return off whichever confirmation carried it into a
//! shared pool, and answers a confirmation only once every return that could belong to it is
//! in the pool. The owner then claims a return from the pool by its message's content
//! (exchange, routing key, body): the broker sends a message's return before its ack, so by
//! the time the ack is read the return has been handed to a confirmation that resolved no
//! later — the driver's two sweeps (see [`Driver::poll_round`]) make sure it has been seen.
//! Two messages of equal content are interchangeable: whichever claims the return, the counts
//! of delivered and returned messages are right.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};

use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::{BasicProperties, Channel};
use tokio::sync::oneshot;

/// Returns nobody claimed (their publisher gave up waiting) are kept up to this many, oldest
/// dropped first, so a stray return cannot grow the pool without bound.
const MAX_UNCLAIMED_RETURNS: usize = 1024;

/// The confirm bookkeeping of one publish channel; cheap to clone. Once the last clone and
/// the last [`Pending`] are dropped (the link replaced the channel), the driver ends: nobody
/// is left to answer.
#[derive(Clone)]
pub(super) struct Confirms(Arc<Book>);

/// What publishers and the driver share.
struct Book(Mutex<Shared>);

#[derive(Default)]
struct Shared {
    /// The number the next publish's ticket gets.
    next_ticket: u64,
    /// Tickets of publishes whose confirmation the driver has not been handed yet: the
    /// driver answers nothing while one older than its round is open (that confirmation may
    /// hold someone's return).
    open: BTreeSet<u64>,
    /// Confirmations handed over since the driver last looked.
    incoming: Vec<Watched>,
    /// Returns taken off confirmations, waiting for their owner to claim them.
    returns: VecDeque<BasicReturnMessage>,
    /// The driver's waker, woken when a confirmation is handed over or a ticket closes.
    driver: Option<Waker>,
}

/// A confirmation and where its answer goes.
struct Watched {
    confirm: PublisherConfirm,
    answer: oneshot::Sender<lapin::Result<Confirmation>>,
}

impl Confirms {
    /// A book for a channel in confirm mode, with its driver spawned on the current runtime.
    pub(super) fn spawn() -> Self {
        let book = Arc::new(Book(Mutex::new(Shared::default())));
        tokio::spawn(Driver::new(Arc::downgrade(&book)).run());
        Self(book)
    }

    /// Publishes one message on `channel` (which must be this book's) and returns what
    /// awaits its confirmation.
    pub(super) async fn send<'a>(
        &self,
        channel: &Channel,
        exchange: &'a str,
        routing_key: &'a str,
        body: &'a [u8],
        options: BasicPublishOptions,
        properties: BasicProperties,
    ) -> lapin::Result<Pending<'a>> {
        let ticket = Ticket::new(&self.0);
        let confirm = channel
            .basic_publish(exchange, routing_key, options, body, properties)
            .await?;
        let answer = ticket.hand_over(confirm);
        Ok(Pending {
            book: self.0.clone(),
            answer,
            exchange,
            routing_key,
            body,
            mandatory: options.mandatory,
        })
    }
}

impl Book {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Book {
    /// The driver ends once the book is gone; wake it so it notices.
    fn drop(&mut self) {
        self.lock().wake_driver();
    }
}

impl Shared {
    /// Closes ticket `number`: the driver may have been holding a round back for it.
    fn close(&mut self, number: u64) {
        self.open.remove(&number);
        self.wake_driver();
    }

    fn wake_driver(&mut self) {
        if let Some(driver) = self.driver.take() {
            driver.wake();
        }
    }
}

/// A publish in progress: open from before the message is written until its confirmation
/// is handed to the driver (or the publish failed), so the driver never answers while a
/// confirmation it has not seen could hold someone's return.
struct Ticket<'b> {
    book: &'b Book,
    number: u64,
    handed_over: bool,
}

impl<'b> Ticket<'b> {
    fn new(book: &'b Book) -> Self {
        let mut shared = book.lock();
        let number = shared.next_ticket;
        shared.next_ticket += 1;
        shared.open.insert(number);
        Self {
            book,
            number,
            handed_over: false,
        }
    }

    fn hand_over(
        mut self,
        confirm: PublisherConfirm,
    ) -> oneshot::Receiver<lapin::Result<Confirmation>> {
        let (answer, receiver) = oneshot::channel();
        // Queued and closed under one lock: the driver never sees the ticket closed
        // without its confirmation.
        let mut shared = self.book.lock();
        shared.incoming.push(Watched { confirm, answer });
        shared.close(self.number);
        self.handed_over = true;
        receiver
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        // A publish that failed before its confirmation existed holds no round back.
        if !self.handed_over {
            self.book.lock().close(self.number);
        }
    }
}

/// A sent message awaiting its confirmation.
pub(super) struct Pending<'a> {
    book: Arc<Book>,
    answer: oneshot::Receiver<lapin::Result<Confirmation>>,
    exchange: &'a str,
    routing_key: &'a str,
    body: &'a [u8],
    mandatory: bool,
}

impl Pending<'_> {
    /// The broker's answer: `Ack(Some(_))` / `Nack(Some(_))` exactly when this message was
    /// returned.
    pub(super) async fn confirmed(mut self) -> lapin::Result<Confirmation> {
        let confirmation = match (&mut self.answer).await {
            Ok(confirmation) => confirmation?,
            // The driver ended without answering: only when the runtime shuts down.
            Err(_) => {
                return Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                    lapin::ChannelState::Closed,
                    "the confirm driver ended",
                )));
            }
        };
        let returned = if self.mandatory {
            self.claim_return()
        } else {
            None
        };
        Ok(match confirmation {
            Confirmation::Ack(_) => Confirmation::Ack(returned.map(Box::new)),
            Confirmation::Nack(_) => Confirmation::Nack(returned.map(Box::new)),
            Confirmation::NotRequested => Confirmation::NotRequested,
        })
    }

    /// Takes this message's return out of the pool, if the broker returned it.
    fn claim_return(&self) -> Option<BasicReturnMessage> {
        let mut shared = self.book.lock();
        let position = shared.returns.iter().position(|r| {
            r.delivery.exchange.as_str() == self.exchange
                && r.delivery.routing_key.as_str() == self.routing_key
                && r.delivery.data == self.body
        })?;
        shared.returns.remove(position)
    }
}

/// The task that watches a channel's confirmations.
struct Driver {
    book: Weak<Book>,
    watched: Vec<Entry>,
    /// The round in progress, waiting for the tickets numbered below this to be handed over.
    round: Option<u64>,
}

struct Entry {
    confirm: Option<PublisherConfirm>,
    outcome: Option<lapin::Result<Confirmation>>,
    /// The outcome was recorded in an earlier sweep than the current round's last one, so
    /// every confirmation that could hold its return has been looked at.
    settled: bool,
    answer: oneshot::Sender<lapin::Result<Confirmation>>,
}

impl Driver {
    fn new(book: Weak<Book>) -> Self {
        Self {
            book,
            watched: Vec::new(),
            round: None,
        }
    }

    async fn run(mut self) {
        std::future::poll_fn(|cx| self.poll_round(cx)).await;
    }

    /// One round: sweep A records which confirmations have resolved and notes the next
    /// ticket number; once every publish with an older ticket has handed over its
    /// confirmation, those are taken in and sweep B looks at every unresolved confirmation
    /// again. A confirmation that resolved before sweep A ended did so before sweep B, and
    /// one not yet written then cannot have resolved before it, so any return read before
    /// those (the broker sends a message's return before its ack) is now in the pool: the
    /// confirmations resolved in sweep A or earlier are answered. Those resolved in sweep B
    /// wait for the next round. Publishes that start during a round never hold it up.
    fn poll_round(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(book) = self.book.upgrade() else {
            // Every publisher is gone; whoever still waits is answered by the sender's drop.
            return Poll::Ready(());
        };
        let round = match self.round {
            Some(round) => round,
            None => {
                self.sweep(&book, cx);
                for entry in &mut self.watched {
                    entry.settled = entry.outcome.is_some();
                }
                *self.round.insert(book.lock().next_ticket)
            }
        };
        {
            let mut shared = book.lock();
            shared.driver = Some(cx.waker().clone());
            if shared.open.first().is_some_and(|&open| open < round) {
                return Poll::Pending;
            }
            self.watched
                .extend(shared.incoming.drain(..).map(|w| Entry {
                    confirm: Some(w.confirm),
                    outcome: None,
                    settled: false,
                    answer: w.answer,
                }));
        }
        self.round = None;
        let resolved_late = self.sweep(&book, cx);
        let mut i = 0;
        while i < self.watched.len() {
            if self.watched[i].settled {
                let entry = self.watched.swap_remove(i);
                if let Some(outcome) = entry.outcome {
                    let _ = entry.answer.send(outcome);
                }
            } else {
                i += 1;
            }
        }
        if resolved_late {
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }

    /// Polls every unresolved confirmation, recording outcomes and pooling the returns they
    /// carry; true if any resolved.
    fn sweep(&mut self, book: &Book, cx: &mut Context<'_>) -> bool {
        let mut any = false;
        let mut pooled = Vec::new();
        for entry in &mut self.watched {
            let Some(confirm) = entry.confirm.as_mut() else {
                continue;
            };
            let Poll::Ready(outcome) = Pin::new(confirm).poll(cx) else {
                continue;
            };
            entry.confirm = None;
            any = true;
            entry.outcome = Some(outcome.map(|confirmation| match confirmation {
                Confirmation::Ack(returned) => {
                    pooled.extend(returned);
                    Confirmation::Ack(None)
                }
                Confirmation::Nack(returned) => {
                    pooled.extend(returned);
                    Confirmation::Nack(None)
                }
                Confirmation::NotRequested => Confirmation::NotRequested,
            }));
        }
        if !pooled.is_empty() {
            let mut shared = book.lock();
            shared.returns.extend(pooled.into_iter().map(|r| *r));
            while shared.returns.len() > MAX_UNCLAIMED_RETURNS {
                shared.returns.pop_front();
            }
        }
        any
    }
}
