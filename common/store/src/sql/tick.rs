//! One write transaction per tick for the hot writes of a SQLite database.
//!
//! The host's hot writes come from independent group commits (the ingest's events, the run
//! starts, the result sink's items): each collects what is pending of its own kind and writes
//! it as one transaction. On SQLite all of them go through the one writer connection (see "One
//! SQLite writer" in the module docs of [`super`]), so under load they queue for it and each
//! pays its own `BEGIN`, `COMMIT`, pool checkout and the ping sqlx sends when the connection is
//! returned: every one a hand-over to the connection's thread and back, during which every
//! other write waits.
//!
//! A [`Seat`] is a write's turn in the writer's current *tick*, a transaction shared by every
//! write that queued while it was open:
//!
//! ```text
//!  starts ──┐ seat: BEGIN, write ─ left open: a write is queued ─┐
//!  items  ──┤ seat:        write ─ left open ───────────────────┤ answers after the COMMIT
//!  ingest ──┘ seat:        write ─ nothing queued: COMMIT ───────┘
//! ```
//!
//! A write takes its seat (queueing in order for the tick's lock), writes in the tick's
//! transaction, and [`Seat::settle`]s: when no other write is queued it commits the tick
//! itself (with one write in flight a tick costs exactly what the write's own transaction
//! did), otherwise it leaves the tick open for the next write and waits for the commit. Nothing
//! ever waits for more writes than are already queued, so ticks grow with the load by
//! themselves (natural batching, as in the group commits above it).
//!
//! A write that fails rolls the whole tick back: the writes that ran in it before are told so
//! and run again (their callers still hold everything they wrote), and the failing write
//! answers its own error — the writes before it would have committed first in a transaction
//! each, so it fails as it would have alone. A write whose caller is dropped half way drops the
//! tick's transaction with it, which rolls back the same way; the commit of a tick other writes
//! wait on runs in a task of its own, so a caller dropped while committing never leaves them
//! reading a commit that landed as a rollback. A tick left open whose queued
//! writes are all dropped before their turn is committed by the tick's closer task, which is
//! told whenever a tick is left open and takes its turn behind the writes then queued.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, RuntimeErr, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
};
use tokio::sync::{Mutex, MutexGuard, Notify, watch};

use crate::error::{Result, StoreError};

/// Runs a write in the writer's current tick and answers what it wrote once the tick is
/// committed: `write_in_tick!(store, |txn| write_in(txn, &what))` takes a [`Seat`] from
/// `store` ([`SqlStore::seat`](super::SqlStore::seat)), awaits the write expression with `txn`
/// bound to the seat's transaction, and [`Seat::settle`]s it, from a new seat again for as
/// long as a later write rolls the tick back. The write must therefore be repeatable from what
/// the caller still holds. Evaluates to the answer; a seat that cannot be taken returns its
/// error from the enclosing function (`?`).
///
/// A macro rather than a function taking the write as a closure: the write's future borrows
/// both the transaction and the caller's data, which a closure returning a boxed future over
/// a higher-ranked lifetime cannot express.
macro_rules! write_in_tick {
    ($store:expr, |$txn:ident| $write:expr) => {
        loop {
            let seat = $store.seat().await?;
            let $txn = seat.txn();
            let written = $write.await;
            if let Some(answer) = seat.settle(written).await {
                break answer;
            }
        }
    };
}
pub(super) use write_in_tick;

/// A tick's outcome as its waiting writes see it: `None` until it is committed, then the
/// commit's error if it failed. A tick rolled back drops its sender instead.
type Outcome = Option<std::result::Result<(), String>>;

/// The writer's ticks (see the module docs). Cheap to clone; the closer task ends with the
/// last clone.
#[derive(Debug, Clone)]
pub(super) struct Ticks {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    writer: DatabaseConnection,
    /// The tick open for the next write, if any; its lock is the queue of writes.
    open: Mutex<Option<Tick>>,
    /// Writes waiting for the lock: a write that finds none commits the tick itself.
    queued: AtomicUsize,
    /// Wakes the closer: a tick was left open for queued writes.
    left_open: Arc<Notify>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The closer finds no store behind the wake and ends.
        self.left_open.notify_one();
    }
}

/// An open tick: its transaction and the channel its writes wait on.
#[derive(Debug)]
struct Tick {
    txn: DatabaseTransaction,
    outcome: watch::Sender<Outcome>,
    /// The tick was left open at least once: the closer was told, and writes wait on it.
    closer_told: bool,
}

impl Tick {
    /// Commits the tick and tells the writes waiting on it.
    async fn commit(self) -> std::result::Result<(), DbErr> {
        let committed = self.txn.commit().await;
        let told = committed.as_ref().copied().map_err(ToString::to_string);
        self.outcome.send_replace(Some(told));
        committed
    }
}

impl Ticks {
    /// Ticks of writes on `writer`, the store's one writer connection; spawns the closer on
    /// the current runtime.
    pub(super) fn spawn(writer: DatabaseConnection) -> Self {
        let left_open = Arc::new(Notify::new());
        let inner = Arc::new(Inner {
            writer,
            open: Mutex::new(None),
            queued: AtomicUsize::new(0),
            left_open: Arc::clone(&left_open),
        });
        tokio::spawn(close_left_open(Arc::downgrade(&inner), left_open));
        Self { inner }
    }

    /// Waits for this write's turn in the current tick (opening one with `BEGIN IMMEDIATE`
    /// when none is open).
    pub(super) async fn seat(&self) -> Result<Seat<'_>> {
        let mut seat = self.turn().await;
        let tick = match seat.shared.as_mut().and_then(|(guard, _)| guard.take()) {
            Some(tick) => tick,
            None => self.open().await?,
        };
        seat.tick = Some(tick);
        Ok(seat)
    }

    /// Waits for the tick's lock: a seat without its tick yet.
    async fn turn(&self) -> Seat<'_> {
        let guard = {
            let _queued = Queued::count(&self.inner.queued);
            self.inner.open.lock().await
        };
        Seat {
            shared: Some((guard, &self.inner)),
            tick: None,
        }
    }

    /// A new tick.
    async fn open(&self) -> Result<Tick> {
        Ok(Tick {
            txn: begin(&self.inner.writer).await?,
            outcome: watch::Sender::new(None),
            closer_told: false,
        })
    }
}

/// Begins a write transaction (`BEGIN IMMEDIATE` on SQLite: see the module docs of
/// [`super`]) on `writer`.
pub(super) async fn begin(writer: &DatabaseConnection) -> Result<DatabaseTransaction> {
    Ok(writer
        .begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        })
        .await?)
}

/// Counts a write waiting for the tick's lock, for as long as it waits (a write dropped
/// while queued is no longer counted).
struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    fn count(queued: &'a AtomicUsize) -> Self {
        queued.fetch_add(1, Ordering::SeqCst);
        Self(queued)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A write's turn: the transaction to write in ([`Seat::txn`]) until [`Seat::settle`].
/// Dropped before it settles, it rolls its tick back (see the module docs).
#[derive(Debug)]
pub(crate) struct Seat<'a> {
    /// The tick's lock and its owner; `None` for a store without ticks.
    shared: Option<(MutexGuard<'a, Option<Tick>>, &'a Inner)>,
    /// The transaction to write in (taken out by `settle`).
    tick: Option<Tick>,
}

impl Seat<'_> {
    /// A transaction of the write's own (a store without ticks).
    pub(super) fn alone(txn: DatabaseTransaction) -> Self {
        Self {
            shared: None,
            tick: Some(Tick {
                txn,
                outcome: watch::Sender::new(None),
                closer_told: true,
            }),
        }
    }

    /// The transaction to write in.
    pub(crate) fn txn(&self) -> &DatabaseTransaction {
        &self
            .tick
            .as_ref()
            .expect("a seat holds its tick until it settles")
            .txn
    }

    /// Ends the write's turn with what it `written`: `None` when its tick was rolled back
    /// by another write and the caller must write again from a new seat; otherwise the
    /// write's answer, after the tick committed (an error of the write itself rolls the tick
    /// back and is the answer). Callers loop, through [`write_in_tick!`].
    pub(crate) async fn settle<T>(mut self, written: Result<T>) -> Option<Result<T>> {
        let tick = self.tick.take().expect("a seat settles once");
        let value = match written {
            Ok(value) => value,
            // Dropping the tick rolls it back; its earlier writes see their outcome's
            // sender gone and write again.
            Err(error) => return Some(Err(error)),
        };
        let Some((mut guard, inner)) = self.shared.take() else {
            return Some(tick.txn.commit().await.map(|()| value).map_err(Into::into));
        };
        if inner.queued.load(Ordering::SeqCst) == 0 {
            let committed = if tick.closer_told {
                // Writes wait on this tick: its commit runs to the end and tells them even if
                // this write's caller is dropped meanwhile (dropped half way, the commit could
                // still land while they read the silence as a rollback and write again).
                tokio::spawn(tick.commit()).await.unwrap_or_else(|error| {
                    Err(DbErr::Custom(format!(
                        "the shared commit's task failed: {error}"
                    )))
                })
            } else {
                tick.commit().await
            };
            drop(guard);
            return Some(committed.map(|()| value).map_err(Into::into));
        }
        let mut outcome = tick.outcome.subscribe();
        let tell_closer = !tick.closer_told;
        *guard = Some(Tick {
            closer_told: true,
            ..tick
        });
        drop(guard);
        if tell_closer {
            inner.left_open.notify_one();
        }
        match outcome.wait_for(Option::is_some).await {
            Ok(told) => match told.as_ref() {
                Some(Ok(())) => Some(Ok(value)),
                Some(Err(message)) => Some(Err(commit_failed(message))),
                None => None,
            },
            // Rolled back by a later write of the tick.
            Err(_) => None,
        }
    }
}

/// The error a write of a tick whose commit failed answers: the commit's error, as text (a
/// database error is not `Clone`), counted as transient (the write was not committed and
/// may be made again).
fn commit_failed(message: &str) -> StoreError {
    StoreError::Database(DbErr::Conn(RuntimeErr::Internal(format!(
        "the shared commit failed: {message}"
    ))))
}

/// The closer: commits a tick left open once its turn comes, if the writes queued behind it
/// did not (they were dropped before their turn). Ends with the store.
async fn close_left_open(inner: Weak<Inner>, left_open: Arc<Notify>) {
    loop {
        left_open.notified().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let mut open = inner.open.lock().await;
        if let Some(tick) = open.take()
            && let Err(error) = tick.commit().await
        {
            tracing::warn!(%error, "a shared write transaction failed to commit");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;
    use std::time::Duration;

    use sea_orm::{ConnectionTrait, Database};

    use super::*;

    /// A file database (so a second pool reads only what was committed) with one table.
    async fn database() -> (tempfile::TempDir, Ticks, DatabaseConnection) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let writer = Database::connect(&url).await.unwrap();
        writer
            .execute_unprepared("PRAGMA journal_mode = WAL; CREATE TABLE t (v TEXT)")
            .await
            .unwrap();
        let reader = Database::connect(&url).await.unwrap();
        (dir, Ticks::spawn(writer), reader)
    }

    async fn insert(txn: &DatabaseTransaction, v: &str) -> Result<()> {
        txn.execute_unprepared(&format!("INSERT INTO t VALUES ('{v}')"))
            .await?;
        Ok(())
    }

    async fn rows(db: &impl ConnectionTrait) -> Vec<String> {
        db.query_all_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT v FROM t ORDER BY v",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get("", "v").unwrap())
        .collect()
    }

    /// Polls `future` exactly once: whether it is still pending (it is then queued or
    /// waiting).
    async fn pending<F: Future + ?Sized>(future: Pin<&mut F>) -> bool {
        let mut future = Some(future);
        std::future::poll_fn(|cx| {
            let future = future.take().expect("polled once");
            Poll::Ready(future.poll(cx).is_pending())
        })
        .await
    }

    type Waiting<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

    /// A first write (of `a`, answering 1) whose tick is left open for a second write queued
    /// behind it: the second's seat, its turn next, and the first's answer, waiting.
    async fn first_left_open_for_second(
        ticks: &Ticks,
    ) -> (
        Waiting<'_, Result<Seat<'_>>>,
        Waiting<'_, Option<Result<i32>>>,
    ) {
        let first = ticks.seat().await.unwrap();
        insert(first.txn(), "a").await.unwrap();
        let mut second: Waiting<'_, _> = Box::pin(ticks.seat());
        assert!(pending(second.as_mut()).await, "queued behind the first");
        let mut first_settled: Waiting<'_, _> = Box::pin(first.settle(Ok(1)));
        assert!(
            pending(first_settled.as_mut()).await,
            "a write is queued: the tick is left open for it"
        );
        (second, first_settled)
    }

    #[tokio::test]
    async fn a_write_alone_commits_its_own_tick() {
        let (_dir, ticks, reader) = database().await;
        let seat = ticks.seat().await.unwrap();
        insert(seat.txn(), "a").await.unwrap();
        assert_eq!(seat.settle(Ok(7)).await.unwrap().unwrap(), 7);
        assert_eq!(rows(&reader).await, ["a"]);
    }

    #[tokio::test]
    async fn a_write_queued_behind_another_shares_its_transaction_and_commit() {
        let (_dir, ticks, reader) = database().await;
        let (second, first_settled) = first_left_open_for_second(&ticks).await;
        let second = second.await.unwrap();
        // The first write's row, uncommitted, is in the second's transaction.
        assert_eq!(rows(second.txn()).await, ["a"]);
        assert!(rows(&reader).await.is_empty());
        insert(second.txn(), "b").await.unwrap();
        assert_eq!(second.settle(Ok(2)).await.unwrap().unwrap(), 2);
        assert_eq!(first_settled.await.unwrap().unwrap(), 1);
        assert_eq!(rows(&reader).await, ["a", "b"]);
    }

    #[tokio::test]
    async fn a_failing_write_rolls_its_tick_back_and_the_writes_before_it_write_again() {
        let (_dir, ticks, reader) = database().await;
        let (second, first_settled) = first_left_open_for_second(&ticks).await;
        let second = second.await.unwrap();
        insert(second.txn(), "b").await.unwrap();
        let failed = second
            .settle::<()>(Err(StoreError::invalid("no")))
            .await
            .unwrap();
        assert!(matches!(failed, Err(StoreError::InvalidArgument(_))));
        assert!(
            first_settled.await.is_none(),
            "the first write is told to write again"
        );
        assert!(rows(&reader).await.is_empty(), "nothing was committed");
        // Written again, alone, it commits.
        let again = ticks.seat().await.unwrap();
        insert(again.txn(), "a").await.unwrap();
        assert_eq!(again.settle(Ok(1)).await.unwrap().unwrap(), 1);
        assert_eq!(rows(&reader).await, ["a"]);
    }

    #[tokio::test]
    async fn a_write_dropped_half_way_rolls_its_tick_back() {
        let (_dir, ticks, reader) = database().await;
        let (second, first_settled) = first_left_open_for_second(&ticks).await;
        let second = second.await.unwrap();
        insert(second.txn(), "b").await.unwrap();
        drop(second);
        assert!(first_settled.await.is_none());
        assert!(rows(&reader).await.is_empty());
    }

    #[tokio::test]
    async fn a_shared_tick_commits_and_tells_its_writes_when_the_committing_write_is_dropped() {
        let (_dir, ticks, reader) = database().await;
        let (second, first_settled) = first_left_open_for_second(&ticks).await;
        let second = second.await.unwrap();
        insert(second.txn(), "b").await.unwrap();
        // Nothing is queued: the second write commits the tick, and is dropped as it does.
        let mut committing = Box::pin(second.settle(Ok(2)));
        assert!(pending(committing.as_mut()).await);
        drop(committing);
        let answer = tokio::time::timeout(Duration::from_secs(5), first_settled)
            .await
            .expect("the first write is told");
        assert_eq!(
            answer.unwrap().unwrap(),
            1,
            "told committed, not to write again"
        );
        assert_eq!(rows(&reader).await, ["a", "b"]);
    }

    #[tokio::test]
    async fn a_tick_left_open_for_a_write_that_never_comes_is_committed_by_the_closer() {
        let (_dir, ticks, reader) = database().await;
        let (second, first_settled) = first_left_open_for_second(&ticks).await;
        // The queued write is dropped before its turn.
        drop(second);
        let answer = tokio::time::timeout(Duration::from_secs(5), first_settled)
            .await
            .expect("the closer commits the tick");
        assert_eq!(answer.unwrap().unwrap(), 1);
        assert_eq!(rows(&reader).await, ["a"]);
    }
}
