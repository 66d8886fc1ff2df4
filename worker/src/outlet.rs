//! [`ResultOutlet`]: where a worker hands its runs' result items when they need not travel
//! the results queue.
//!
//! By default a worker publishes every run's items to `switchboard.results`, and an
//! orchestrator's result sink stores, applies and delivers them (SPEC §2 steps 3–4). The
//! binary that starts the worker may give it an outlet instead: the result sink itself, run in
//! the worker's process over the same ledger, session store and bus. A run's first item then
//! reaches its readers without a confirmed quorum-queue write, a delivery and a settlement in
//! between, and the broker carries one message fewer per run. The guarantees are the
//! sink's: an item is stored before it is delivered, a run's items are applied in order (a
//! run hands over its next items only after the previous ones were taken), and a batch that
//! fails is handed over again whole, marked retried, so its stored items are applied again
//! (every side effect is idempotent).
//!
//! The worker crate only defines the seam: it depends on no other role, and whoever composes
//! the roles (the `switchboard` binary) plugs the sink in.

use async_trait::async_trait;
use sb_protocol::messages::ResultMessage;

/// Takes a run's result items from the worker that produced them.
///
/// # Contract
/// - `messages` are consecutive items of **one** run, ascending by sequence, never empty; the
///   worker hands over a run's next items only after this call returned `Ok` for the
///   previous ones.
/// - `Ok` means every item is durable in the ledger (and its side effects and live delivery
///   are done or, for the delivery, attempted): the worker may forget them and, after the
///   terminal item, end the run.
/// - [`OutletError::Unavailable`]: nothing may be assumed; the worker hands the same items
///   over again after a delay, with `retried` set.
/// - [`OutletError::Refused`]: the outlet will never take these items; the worker publishes
///   them to the results queue instead, whose consumer settles them as any delivery (dead
///   letters included).
#[async_trait]
pub trait ResultOutlet: Send + Sync + 'static {
    /// Hands over `messages` (see the trait's contract).
    async fn hand_over(&self, messages: &[ResultMessage], retried: bool)
    -> Result<(), OutletError>;
}

/// Why an outlet did not take a run's items.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutletError {
    /// A backend it needs is unreachable or failed transiently: hand them over again later.
    #[error("result outlet unavailable: {0}")]
    Unavailable(String),
    /// It will never take them: publish them to the results queue.
    #[error("result outlet refused the items: {0}")]
    Refused(String),
}
