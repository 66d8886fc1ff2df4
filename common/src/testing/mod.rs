//! Conformance suites shared by every backend of the bus and the session store (feature
//! `test-util`), in the style of quickwit's `metastore_test_suite!` and restate's loglet
//! tests: one generic async test function per contract point, and a macro that instantiates
//! all of them as `#[tokio::test]`s for one backend.
//!
//! ```ignore
//! sb_common::bus_suite!(memory, || async { sb_common::testing::BusFixture::memory() });
//! sb_common::session_suite!(memory, || async { sb_common::testing::SessionFixture::memory() });
//! ```
//!
//! The fixture constructor runs once per test, so each test gets its own names (a unique
//! prefix on shared brokers) and cleans up after itself when the fixture is dropped — also
//! when the test panics.
//!
//! # Layout
//! - this file: [`BusFixture`], [`SessionFixture`], the macros.
//! - [`bus`]: one `pub async fn` per bus contract point.
//! - [`dead_letters`]: one `pub async fn` per point of the dead-letter contract, and
//!   [`DeadLettersFixture`].
//! - [`session`]: one `pub async fn` per session-store contract point.

use std::sync::{Arc, Mutex};

use crate::bus::Bus;
use crate::bus::memory::MemoryBus;
use crate::session::SessionStore;
use crate::session::memory::MemorySessionStore;

pub mod bus;
pub mod dead_letters;
pub mod session;

pub use dead_letters::DeadLettersFixture;

/// A unique name prefix for one test (`test-<uuid>.`).
pub fn unique_prefix() -> String {
    format!("test-{}.", uuid::Uuid::new_v4().simple())
}

/// Teardown of a fixture: receives every name the test created.
pub type Teardown = Box<dyn FnOnce(Vec<String>) + Send>;

/// One bus for one test, with a name prefix and a teardown.
pub struct BusFixture {
    /// The bus under test.
    pub bus: Arc<dyn Bus>,
    prefix: String,
    names: Mutex<Vec<String>>,
    teardown: Option<Teardown>,
}

impl BusFixture {
    /// A fixture on `bus`; every name the suite uses starts with `prefix`.
    pub fn new(bus: Arc<dyn Bus>, prefix: impl Into<String>) -> Self {
        Self {
            bus,
            prefix: prefix.into(),
            names: Mutex::default(),
            teardown: None,
        }
    }

    /// A fixture on a fresh [`MemoryBus`].
    pub fn memory() -> Self {
        Self::new(Arc::new(MemoryBus::new()), unique_prefix())
    }

    /// Runs `teardown` with every name created through [`name`](Self::name) when the fixture
    /// is dropped (it must not need the test's runtime: it may run during a panic).
    #[must_use]
    pub fn with_teardown(mut self, teardown: Teardown) -> Self {
        self.teardown = Some(teardown);
        self
    }

    /// The prefix of this fixture.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A prefixed exchange or queue name, remembered for teardown.
    pub fn name(&self, base: &str) -> String {
        let name = format!("{}{base}", self.prefix);
        self.remember(name.clone());
        name
    }

    /// Remembers a name made elsewhere (e.g. by a [`Topology`](crate::bus::topology::Topology))
    /// for teardown.
    pub fn remember(&self, name: String) {
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name);
    }
}

impl Drop for BusFixture {
    fn drop(&mut self) {
        if let Some(teardown) = self.teardown.take() {
            let names = std::mem::take(&mut *self.names.lock().unwrap_or_else(|p| p.into_inner()));
            teardown(names);
        }
    }
}

/// One session store for one test, with a teardown.
pub struct SessionFixture {
    /// The store under test (its key prefix is unique to the test).
    pub store: Arc<dyn SessionStore>,
    teardown: Option<Box<dyn FnOnce() + Send>>,
}

impl SessionFixture {
    /// A fixture on `store`.
    pub fn new(store: Arc<dyn SessionStore>) -> Self {
        Self {
            store,
            teardown: None,
        }
    }

    /// A fixture on a fresh [`MemorySessionStore`].
    pub fn memory() -> Self {
        Self::new(Arc::new(MemorySessionStore::with_prefix(unique_prefix())))
    }

    /// Runs `teardown` when the fixture is dropped (not on the test's runtime).
    #[must_use]
    pub fn with_teardown(mut self, teardown: Box<dyn FnOnce() + Send>) -> Self {
        self.teardown = Some(teardown);
        self
    }
}

impl Drop for SessionFixture {
    fn drop(&mut self) {
        if let Some(teardown) = self.teardown.take() {
            teardown();
        }
    }
}

/// Runs `f` to completion on a fresh current-thread runtime in a new OS thread and waits for
/// it: teardowns run from `Drop` (possibly while a test panics), where the test's runtime
/// cannot be used.
pub fn run_detached<F>(f: impl FnOnce() -> F + Send + 'static)
where
    F: std::future::Future<Output = ()>,
{
    let handle = std::thread::spawn(move || {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime.block_on(f()),
            Err(e) => eprintln!("teardown: cannot build a runtime: {e}"),
        }
    });
    let _ = handle.join();
}

/// Upper bound for one conformance test; a hung backend fails the test instead of the run.
pub const TEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);

/// Instantiates the bus conformance suite: `bus_suite!(module_name, async_fixture_ctor)`.
/// The constructor is any expression callable as `ctor().await -> BusFixture`.
#[macro_export]
macro_rules! bus_suite {
    ($name:ident, $fixture:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::__conformance_tests!(bus, BusFixture, $fixture;
                publish_then_consume,
                declare_is_idempotent_and_detects_conflicts,
                retiring_a_queue_spares_one_in_use,
                a_lowered_shard_count_retires_the_shards_above_it,
                ack_removes_the_message,
                nack_with_requeue_redelivers,
                requeued_message_comes_again_without_loss,
                nack_without_requeue_dead_letters,
                dropped_subscription_redelivers_unacked,
                dropped_delivery_is_requeued,
                settles_in_a_burst_leave_a_held_delivery_alone,
                prefetch_bounds_unacked_deliveries,
                shared_queue_round_robins,
                single_active_consumer_exclusive_and_takeover,
                topic_wildcards_route,
                fanout_reaches_every_bound_queue,
                unroutable_mandatory_message_fails,
                publish_to_missing_exchange_fails,
                best_effort_publishes_keep_order_and_never_wedge,
                batch_publish_confirms_every_message,
                batch_publish_reports_failed_indices,
                returns_reach_their_own_publisher,
                bind_and_unbind_on_a_live_exclusive_queue,
                exclusive_queue_is_deleted_with_its_subscription,
                delivery_limit_dead_letters_poison_messages,
                topology_routes_every_message_kind,
                closed_bus_ends_subscriptions,
            );
        }
    };
}

/// Instantiates the dead-letter conformance suite: `dead_letters_suite!(module_name, ctor)`.
/// The constructor is any expression callable as `ctor().await -> DeadLettersFixture`.
#[macro_export]
macro_rules! dead_letters_suite {
    ($name:ident, $fixture:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::__conformance_tests!(dead_letters, DeadLettersFixture, $fixture;
                over_limit_message_is_peeked_with_its_origin,
                peek_keeps_messages_and_order,
                replay_returns_a_message_to_its_queue,
                replay_selects_by_limit_and_id,
                replay_leaves_what_it_cannot_send_back,
                replay_keeps_the_order_of_what_it_leaves,
                replay_is_one_pass,
                purge_empties_the_dead_queue,
                missing_queue_is_not_found,
            );
        }
    };
}

/// Instantiates the session-store conformance suite: `session_suite!(module_name, ctor)`.
/// The constructor is any expression callable as `ctor().await -> SessionFixture`.
#[macro_export]
macro_rules! session_suite {
    ($name:ident, $fixture:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::__conformance_tests!(session, SessionFixture, $fixture;
                session_put_get_replace,
                session_ttl_expires_and_touch_extends,
                end_session_returns_the_steering_once,
                end_session_exactly_once_under_concurrency,
                lease_acquire_renew_release,
                lease_acquire_and_get_reads_the_key,
                put_session_and_add_writes_both,
                lease_expiry_lets_another_holder_steal,
                lease_acquire_race_has_one_winner,
                begin_run_takes_the_lease_and_reads_flag_and_session,
                begin_run_race_has_one_winner,
                end_run_ends_the_session_and_hands_the_run_off,
                end_run_exactly_once_under_concurrency,
                steering_cap_and_fifo,
                steering_pull_modes,
                steering_concurrent_pushes_respect_cap,
                steering_requires_a_session,
                counters_are_atomic_under_concurrency,
                counter_ttl_is_set_once,
                budget_stays_exhausted,
                budget_is_atomic_under_concurrency,
                rate_limit_fixed_window,
                set_nx_ex_has_one_winner,
                plain_keys_expire,
                sets_add_remove_members,
                set_remove_then_members_reads_after_the_removal,
                invalid_arguments_are_rejected,
            );
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($suite:ident, $fixture_ty:ident, $fixture:expr; $($test:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let fixture: $crate::testing::$fixture_ty = ($fixture)().await;
                ::tokio::time::timeout(
                    $crate::testing::TEST_TIMEOUT,
                    $crate::testing::$suite::$test(&fixture),
                )
                .await
                .expect("conformance test timed out");
            }
        )*
    };
}
