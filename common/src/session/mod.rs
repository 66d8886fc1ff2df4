//! The session-store boundary: short-lived shared state of active runs.
//!
//! Redis in cluster mode ([`redis::RedisSessionStore`], feature `redis`), a mutex-guarded map in
//! embedded mode and tests ([`memory::MemorySessionStore`]). Both honour the contract on
//! [`SessionStore`]; the conformance suite in `crate::testing::session` checks it against each.
//!
//! # Layout
//! - this file: the [`SessionStore`] trait and its contract, [`EndedSession`], [`RunBegin`],
//!   [`RunEnd`], [`PullMode`], [`PushOutcome`] and [`SessionError`].
//! - [`memory`]: [`memory::MemorySessionStore`] with TTLs on `tokio::time` (pausable in tests).
//! - `redis`: `RedisSessionStore` on one auto-reconnecting `ConnectionManager`, Lua scripts
//!   where the contract says atomic (feature `redis`).
//!
//! # Key space
//! Every store instance has a key prefix; the families below never collide with each other:
//!
//! ```text
//! <prefix>session:<run_id>    run session (JSON)            put/get/touch/end_session, *_run
//! <prefix>steering:<run_id>   steering list (JSON items)    steering_*; dies with the session
//! <prefix>lease:<key>         lease holder                  *_lease, begin_run/end_run
//! <prefix>counter:<key>       integer                       counter_*
//! <prefix>counter:<key>:x     "exhausted" marker            counter_try_add
//! <prefix>rate:<key>          fixed-window hit count        rate_limit_hit
//! <prefix>kv:<key>            bytes                         set_ex/set_nx_ex/get/del, *_run
//! <prefix>set:<key>           set of strings                set_*
//! ```
//!
//! # Keys shared between roles
//! Some keys are written by one role and read by another, so their names are part of the
//! contract between roles and are built only by the functions here: [`cancel_flag_key`],
//! [`run_lease_key`], [`run_handed_off_key`], [`ROUTING_EPOCH_KEY`].
//!
//! # A store that comes back empty
//! The Redis backend may run without persistence: a restart loses every key. Holders of
//! what was lost re-establish it rather than give up: a worker whose run lease is *missing*
//! (not taken by another holder) while the ledger still says the run is its own takes the
//! lease again and puts the run's session back (see `sb_worker::service`); only a lease held
//! by someone else means lost. Runs whose holder is gone have no lease for longer than the
//! orchestrator's `lease_grace` and are finalized `interrupted` by its reaper.

use std::time::Duration;

use async_trait::async_trait;
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::ids::RunId;
use serde_json::Value;

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;

/// Result alias of the session-store boundary.
pub type Result<T, E = SessionError> = std::result::Result<T, E>;

/// Default steering-list capacity (SPEC §13).
pub const STEERING_CAP: usize = 100;

/// The plain key (`<prefix>kv:cancel:<run_id>`; the store adds the family prefix) of a run's
/// cancel flag.
///
/// Cross-role contract: whoever cancels a run — the gateway's `POST /v1/runs/{id}/cancel`,
/// the orchestrator's `interrupt` concurrency policy — sets it with
/// [`set_ex`](SessionStore::set_ex), the cancel reason as UTF-8 value, *before* publishing
/// `cancel.<run_id>` on the control exchange. The worker reads it when it takes the run's
/// lease ([`SessionStore::begin_run`]), before it starts the run, so a cancel published while
/// no worker followed the run yet is still seen; it deletes the flag when the run ends.
#[must_use]
pub fn cancel_flag_key(run_id: &RunId) -> String {
    format!("cancel:{run_id}")
}

/// The plain key (`<prefix>kv:routing-epoch`) of the routing epoch: an opaque value replaced
/// after every committed change of what routing reads (agents and their bindings, registered
/// runners).
///
/// Cross-role contract: whoever changes agents or runners (the gateway's agent routes, a
/// worker registering its runners, the bootstrap of the default agent) calls
/// [`announce_routing_change`] *after* the change is committed; an orchestrator caching what
/// it read for routing reads the epoch (a plain key, with its route lock) before each routing and reloads
/// when it differs from the one its cache was filled under. A store that comes back empty
/// has no epoch, which differs from every announced one, so caches reload then too.
pub const ROUTING_EPOCH_KEY: &str = "routing-epoch";

/// How long an announced routing epoch is kept; one that expired reads as absent, which
/// makes every cache reload once.
pub const ROUTING_EPOCH_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Replaces the routing epoch (see [`ROUTING_EPOCH_KEY`]): call it after a change of agents
/// or runners is committed, never before.
pub async fn announce_routing_change(sessions: &dyn SessionStore) -> Result<()> {
    let epoch = uuid::Uuid::new_v4().simple().to_string();
    sessions
        .set_ex(ROUTING_EPOCH_KEY, epoch.as_bytes(), ROUTING_EPOCH_TTL)
        .await
}

/// The plain key (`<prefix>lease:<run_id>`; the store adds the family prefix) of a run's
/// worker lease.
///
/// Cross-role contract: the worker executing a run holds it (holder = its worker id) from
/// before its claim until the run's end, renewing it every heartbeat; the orchestrator's
/// reaper reads it ([`SessionStore::lease_holder`]) to find runs whose worker is gone.
#[must_use]
pub fn run_lease_key(run_id: &RunId) -> String {
    run_id.to_string()
}

/// The plain key of a run's hand-off marker: set by its worker (value: the worker id) once
/// the run's terminal item is published, for [`RUN_HANDED_OFF_TTL`], just before the worker
/// releases the lease. From then on the run's end is the result sink's to apply, and a sink
/// can lag (an orchestrator that died, whose shards another one takes over): the reaper does
/// not count a run without a lease as lost while its marker exists.
#[must_use]
pub fn run_handed_off_key(run_id: &RunId) -> String {
    format!("handed-off:{run_id}")
}

/// How long a run's hand-off marker lives ([`run_handed_off_key`]): far longer than an
/// orchestrator failover; past it, a run the sink never ended is reaped `interrupted`.
pub const RUN_HANDED_OFF_TTL: Duration = Duration::from_secs(600);

/// Shared, expiring state of active runs.
///
/// # Contract
///
/// **Visibility.** Every operation is linearizable per key: once a call returned, every later
/// call (from any process sharing the store) sees its effect. Operations marked *atomic*
/// below are a single step even under concurrent callers; nothing else is promised across
/// keys.
///
/// **Expiry.** A TTL is a lower bound on how long a value stays visible (to the millisecond,
/// monotonic time); once it passed, the value behaves as absent (reads miss, counters restart
/// from zero, leases are free). TTLs are never extended implicitly, except where stated.
///
/// **Run sessions.** [`put_session`](Self::put_session) stores (or replaces) the run's session
/// with a TTL; [`get_session`](Self::get_session) reads it; [`touch_session`](Self::touch_session)
/// extends the TTL of the session and its steering list. [`end_session`](Self::end_session) is
/// atomic: it removes the session *and* its steering list and returns the list's items, so
/// among concurrent callers exactly one receives `Some` (the one that ends the run and audits
/// the dropped steering items) and every later Host API call sees the session missing. The
/// session itself is not returned: nobody reads it after the run's end, and it is the largest
/// value a run keeps in the store (≈ 2 KB: the frozen authorization and the context's
/// facts), so reading it back would cost every run's end a transfer and a parse.
///
/// **Steering lists.** [`steering_push`](Self::steering_push) appends an item only while the
/// run's session exists and the list holds fewer than `cap` items (atomic check-and-push);
/// the list expires with the session. [`steering_pull`](Self::steering_pull) atomically
/// removes and returns items from the head in push order (FIFO): up to `max` in
/// [`PullMode::All`], at most one in [`PullMode::One`]. No item is returned twice and none is
/// lost between a concurrent push and pull.
///
/// **Leases** (a worker's claim on a run, the reaper's singleton lock, …):
/// [`acquire_lease`](Self::acquire_lease) succeeds if the lease is free, expired, or already
/// held by the same holder (then its TTL is reset); [`renew_lease`](Self::renew_lease) resets
/// the TTL only for the current holder and otherwise fails with [`SessionError::LeaseLost`]
/// (someone else holds it, or it is missing: expired, or lost with the store's data). A holder
/// that sees `LeaseLost` must stop acting on the resource, unless
/// [`lease_holder`](Self::lease_holder) shows the lease free and the holder can prove by
/// other means that the resource is still its own: then it takes the lease again with
/// `acquire_lease` (see "A store that comes back empty" in the module docs);
/// [`release_lease`](Self::release_lease) frees it only for the current holder.
/// All three are atomic compare-and-set operations.
///
/// **A run's execution** (compound steps of the worker, each one round trip on Redis):
/// [`begin_run`](Self::begin_run) takes the run lease ([`run_lease_key`]) exactly as
/// `acquire_lease` does and, only if it is the caller's now, reads the run's cancel flag
/// ([`cancel_flag_key`]) and its session in the same atomic step; if another holder has the
/// lease it changes nothing and names that holder. [`end_run`](Self::end_run), once the run's terminal item is
/// published, does in one atomic step: ends the session exactly as `end_session` does (among
/// concurrent `end_session`/`end_run` callers exactly one receives it), deletes the cancel
/// flag, sets the hand-off marker ([`run_handed_off_key`], value: the holder) for the given
/// TTL, and releases the run lease only if the caller holds it. Where these are separate
/// steps (the provided body) they keep that order: the session ends before the lease is free
/// (a redelivered job takes a present session for a crash) and the marker is set before it
/// (the reaper takes a free lease without marker for a lost worker).
///
/// **Counters.** [`counter_incr`](Self::counter_incr) adds atomically and returns the new
/// value; a missing counter starts at zero; the TTL is set when the counter has none (so a
/// window started by the first increment is not extended by later ones).
/// [`counter_try_add`](Self::counter_try_add) is the budget primitive: atomically, it adds
/// `by` only if the result stays `<= limit`, and otherwise marks the counter exhausted and
/// fails with [`SessionError::Exhausted`]; once exhausted a counter refuses every further add
/// (even one that would fit) until it expires. The value never exceeds `limit`.
/// [`rate_limit_hit`](Self::rate_limit_hit) counts a hit in a fixed window that starts with
/// the first hit and lasts `window`; it returns `false` (denied) for hits beyond
/// `max_per_window` in that window.
///
/// **Plain keys and sets.** `set_ex` / `set_nx_ex` (set only if absent, atomic) / `get` /
/// `del` on byte values with a TTL; `set_add` / `set_remove` / `set_members` on sets of
/// strings (e.g. active runs per conversation);
/// [`set_remove_then_members`](Self::set_remove_then_members) removes a member from one set
/// and reads another set right after, as one atomic step.
///
/// **Failures.** A store that cannot be reached fails with [`SessionError::Unavailable`];
/// the Redis backend reconnects on its own, so a later call can succeed.
#[async_trait]
pub trait SessionStore: Send + Sync + 'static {
    /// Stores (or replaces) a run's session for `ttl`.
    async fn put_session(&self, run_id: &RunId, session: &Value, ttl: Duration) -> Result<()>;

    /// The run's session, or `None` if it never existed, ended or expired.
    async fn get_session(&self, run_id: &RunId) -> Result<Option<Value>>;

    /// Extends the TTL of the run's session (and its steering list) to `ttl` from now. `false`
    /// if there is no session.
    async fn touch_session(&self, run_id: &RunId, ttl: Duration) -> Result<bool>;

    /// Atomically removes the session and its steering list and returns the list's items;
    /// `None` if the session is absent (already ended by someone else, or expired).
    async fn end_session(&self, run_id: &RunId) -> Result<Option<EndedSession>>;

    /// Appends a steering item (atomic check-and-push; see the contract).
    async fn steering_push(&self, run_id: &RunId, item: &Value, cap: usize) -> Result<PushOutcome>;

    /// Atomically removes and returns up to `max` items (`One`: at most one), oldest first.
    async fn steering_pull(&self, run_id: &RunId, max: usize, mode: PullMode)
    -> Result<Vec<Value>>;

    /// Number of queued steering items.
    async fn steering_len(&self, run_id: &RunId) -> Result<usize>;

    /// Takes the lease `key` for `holder` if free, expired or already held by `holder`.
    async fn acquire_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<bool>;

    /// Resets the lease TTL; [`SessionError::LeaseLost`] if `holder` no longer holds it.
    async fn renew_lease(&self, key: &str, holder: &str, ttl: Duration) -> Result<()>;

    /// Frees the lease if `holder` holds it; `false` otherwise.
    async fn release_lease(&self, key: &str, holder: &str) -> Result<bool>;

    /// Current holder of the lease, if any.
    async fn lease_holder(&self, key: &str) -> Result<Option<String>>;

    /// Takes the lease `key` as [`acquire_lease`](Self::acquire_lease) does and reads the
    /// plain key `read` (as [`get`](Self::get)) right after, whether or not the lease was
    /// taken: the router takes an event's route lock and reads the routing epoch with it.
    ///
    /// The Redis backend does this in one round trip of plain commands (a second one, a
    /// script, when `holder` has the lease already). This provided body makes the two calls
    /// one after the other.
    async fn acquire_lease_and_get(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        read: &str,
    ) -> Result<(bool, Option<Vec<u8>>)> {
        let acquired = self.acquire_lease(key, holder, ttl).await?;
        Ok((acquired, self.get(read).await?))
    }

    /// Stores (or replaces) a run's session for `ttl`, as
    /// [`put_session`](Self::put_session), then adds `member` to the set `set` as
    /// [`set_add`](Self::set_add) does with `set_ttl`: a reader that finds the member in the
    /// set finds the session written. The router writes a run's session and its
    /// conversation's active index so.
    ///
    /// The Redis backend does this in one round trip (one script). This provided body makes
    /// the two calls in that order.
    async fn put_session_and_add(
        &self,
        run_id: &RunId,
        session: &Value,
        ttl: Duration,
        set: &str,
        member: &str,
        set_ttl: Option<Duration>,
    ) -> Result<()> {
        self.put_session(run_id, session, ttl).await?;
        self.set_add(set, member, set_ttl).await?;
        Ok(())
    }

    /// Starts `holder`'s execution of a run: takes the run lease for `ttl` and reads what the
    /// worker checks before starting the run (see the contract).
    ///
    /// The Redis and memory backends do this in one atomic step (one round trip): the reads
    /// see the store as it is at the moment the lease is taken. This provided body makes the
    /// calls one after another (each atomic on its own, which is all a worker relies on), for
    /// stores that implement only the primitives.
    async fn begin_run(&self, run_id: &RunId, holder: &str, ttl: Duration) -> Result<RunBegin> {
        let key = run_lease_key(run_id);
        loop {
            if self.acquire_lease(&key, holder, ttl).await? {
                return Ok(RunBegin::Leased {
                    cancel_flag: self.get(&cancel_flag_key(run_id)).await?,
                    session: self.get_session(run_id).await?,
                });
            }
            // A lease that lapsed between the two calls is free: try again.
            if let Some(current) = self.lease_holder(&key).await? {
                return Ok(RunBegin::HeldBy(current));
            }
        }
    }

    /// Ends `holder`'s execution of a run whose terminal item is published: ends the session,
    /// deletes the cancel flag, marks the run handed off for `handed_off_ttl`, releases the
    /// run lease if `holder` holds it (see the contract).
    ///
    /// The Redis and memory backends do this in one atomic step (one round trip). This
    /// provided body makes the calls one after another in the contract's order, for stores
    /// that implement only the primitives; it stops at the first failure.
    async fn end_run(
        &self,
        run_id: &RunId,
        holder: &str,
        handed_off_ttl: Duration,
    ) -> Result<RunEnd> {
        check_ttl(handed_off_ttl)?;
        let ended = self.end_session(run_id).await?;
        self.del(&cancel_flag_key(run_id)).await?;
        self.set_ex(
            &run_handed_off_key(run_id),
            holder.as_bytes(),
            handed_off_ttl,
        )
        .await?;
        let lease_released = self.release_lease(&run_lease_key(run_id), holder).await?;
        Ok(RunEnd {
            ended,
            lease_released,
        })
    }

    /// Adds `by` to the counter and returns the new value; sets `ttl` if the counter has none.
    async fn counter_incr(&self, key: &str, by: i64, ttl: Option<Duration>) -> Result<i64>;

    /// Current counter value (0 if absent).
    async fn counter_get(&self, key: &str) -> Result<i64>;

    /// Budget check-and-add (see the contract). `by` must be `>= 0`. Returns the new value.
    async fn counter_try_add(
        &self,
        key: &str,
        by: i64,
        limit: i64,
        ttl: Option<Duration>,
    ) -> Result<i64>;

    /// Counts one hit; `false` once more than `max_per_window` hits fell in the current window.
    async fn rate_limit_hit(
        &self,
        key: &str,
        max_per_window: u32,
        window: Duration,
    ) -> Result<bool>;

    /// Sets a value with a TTL.
    async fn set_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<()>;

    /// Sets a value with a TTL only if the key is absent; `true` if it was set.
    async fn set_nx_ex(&self, key: &str, value: &[u8], ttl: Duration) -> Result<bool>;

    /// Reads a value.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Deletes a value; `true` if it existed.
    async fn del(&self, key: &str) -> Result<bool>;

    /// Adds a member; `true` if it was new. `ttl`, if given, is (re)set on the whole set.
    async fn set_add(&self, key: &str, member: &str, ttl: Option<Duration>) -> Result<bool>;

    /// Removes a member; `true` if it was there.
    async fn set_remove(&self, key: &str, member: &str) -> Result<bool>;

    /// All members, sorted.
    async fn set_members(&self, key: &str) -> Result<Vec<String>>;

    /// Removes `member` from the set `key` and returns whether it was there, with all members
    /// of the set `members_of` (sorted) as they are right after the removal.
    ///
    /// The Redis and memory backends do this in one atomic step (one round trip). This
    /// provided body makes the two calls one after another (the read still follows the
    /// removal), for stores that implement only the primitives.
    async fn set_remove_then_members(
        &self,
        key: &str,
        member: &str,
        members_of: &str,
    ) -> Result<(bool, Vec<String>)> {
        let removed = self.set_remove(key, member).await?;
        Ok((removed, self.set_members(members_of).await?))
    }

    /// `Ok` while the store is reachable (readiness probes).
    async fn ping(&self) -> Result<()>;
}

/// What [`SessionStore::end_session`] removed besides the session itself.
#[derive(Clone, Debug, PartialEq)]
pub struct EndedSession {
    /// Steering items never pulled, oldest first (to audit as `steering.dropped`).
    pub steering: Vec<Value>,
}

/// What [`SessionStore::begin_run`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum RunBegin {
    /// The run lease is the caller's now (taken, or already its own and its TTL reset).
    Leased {
        /// The raw value of the run's cancel flag (the cancel reason), if it is set.
        cancel_flag: Option<Vec<u8>>,
        /// The run's session, if present: what its holder puts back should the store lose
        /// it (see "A store that comes back empty" in the module docs).
        session: Option<Value>,
    },
    /// Another holder has the lease (its id); nothing was changed or read.
    HeldBy(String),
}

/// What [`SessionStore::end_run`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct RunEnd {
    /// The ended session and its unpulled steering items; `None` if it was already gone.
    pub ended: Option<EndedSession>,
    /// Whether the run lease was the caller's and is now free.
    pub lease_released: bool,
}

/// How many steering items one pull takes (PROTOCOL_V1 `steering_pull` modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PullMode {
    /// Up to `max` items.
    #[default]
    All,
    /// At most one item.
    One,
}

/// Outcome of [`SessionStore::steering_push`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Queued for the run.
    Accepted,
    /// The list is at capacity: dispatch the event normally instead.
    Full,
    /// The run has no session (ended or expired): dispatch the event normally instead.
    NoSession,
}

impl PushOutcome {
    /// `true` for [`PushOutcome::Accepted`].
    pub fn is_accepted(self) -> bool {
        self == Self::Accepted
    }
}

/// Errors of the session-store boundary.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The store cannot be reached.
    #[error("session store unavailable: {0}")]
    Unavailable(String),
    /// The lease is held by someone else, or expired.
    #[error("lease {key:?} lost")]
    LeaseLost {
        /// Lease key (without the store prefix).
        key: String,
    },
    /// A budget counter is exhausted.
    #[error("budget {key:?} exhausted: {used} of {limit} used")]
    Exhausted {
        /// Counter key (without the store prefix).
        key: String,
        /// Value of the counter.
        used: i64,
        /// The limit that was hit.
        limit: i64,
    },
    /// Bad input (negative budget add, zero window, …).
    #[error("invalid session store request: {0}")]
    InvalidArgument(String),
    /// A stored value could not be decoded (written by an incompatible version?).
    #[error("corrupt value at {key:?}: {reason}")]
    Corrupt {
        /// Key (without the store prefix).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Any other store error.
    #[error("session store error: {0}")]
    Internal(String),
}

impl HasErrorCode for SessionError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Unavailable(_) => ErrorCode::Unavailable,
            Self::LeaseLost { .. } => ErrorCode::Conflict,
            Self::Exhausted { .. } => ErrorCode::BudgetExceeded,
            Self::InvalidArgument(_) => ErrorCode::InvalidArgument,
            Self::Corrupt { .. } | Self::Internal(_) => ErrorCode::Internal,
        }
    }
}

/// Rejects inputs every backend refuses the same way.
pub(crate) fn check_ttl(ttl: Duration) -> Result<()> {
    if ttl.is_zero() {
        return Err(SessionError::InvalidArgument("ttl must be positive".into()));
    }
    Ok(())
}

/// TTL in whole milliseconds (rounded up so a sub-millisecond TTL is not zero), for backends.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Key naming shared by the backends (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }
    pub(crate) fn session(&self, run_id: &RunId) -> String {
        format!("{}session:{run_id}", self.prefix)
    }
    pub(crate) fn steering(&self, run_id: &RunId) -> String {
        format!("{}steering:{run_id}", self.prefix)
    }
    pub(crate) fn lease(&self, key: &str) -> String {
        format!("{}lease:{key}", self.prefix)
    }
    pub(crate) fn counter(&self, key: &str) -> String {
        format!("{}counter:{key}", self.prefix)
    }
    pub(crate) fn exhausted(&self, key: &str) -> String {
        format!("{}counter:{key}:x", self.prefix)
    }
    pub(crate) fn rate(&self, key: &str) -> String {
        format!("{}rate:{key}", self.prefix)
    }
    pub(crate) fn kv(&self, key: &str) -> String {
        format!("{}kv:{key}", self.prefix)
    }
    pub(crate) fn set(&self, key: &str) -> String {
        format!("{}set:{key}", self.prefix)
    }
}

/// Parses a stored JSON value.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn decode_json(key: &str, bytes: &[u8]) -> Result<Value> {
    serde_json::from_slice(bytes).map_err(|e| SessionError::Corrupt {
        key: key.to_owned(),
        reason: format!("invalid json: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_millis() {
        assert_eq!(ttl_millis(Duration::from_micros(1)), 1);
        assert_eq!(ttl_millis(Duration::from_millis(1500)), 1500);
        assert_eq!(ttl_millis(Duration::from_micros(1500)), 2);
        assert!(check_ttl(Duration::ZERO).is_err());
        assert!(check_ttl(Duration::from_micros(999)).is_ok());
    }

    #[test]
    fn error_codes() {
        assert_eq!(
            SessionError::LeaseLost { key: "k".into() }.code(),
            ErrorCode::Conflict
        );
        assert_eq!(
            SessionError::Exhausted {
                key: "k".into(),
                used: 1,
                limit: 1
            }
            .code(),
            ErrorCode::BudgetExceeded
        );
        assert_eq!(
            SessionError::Unavailable("x".into()).code(),
            ErrorCode::Unavailable
        );
    }

    #[test]
    fn cancel_flag_key_is_the_shared_wire_name() {
        let run = RunId::new();
        assert_eq!(cancel_flag_key(&run), format!("cancel:{run}"));
    }
}
