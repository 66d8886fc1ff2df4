//! The embedded backends the orchestrator's suites run on, built in one place: an in-memory
//! (or file) SQLite store, migrated; the memory bus with the topology declared under a
//! unique prefix; the memory session store; and the [`OrchestratorDeps`] over them.
//!
//! The orchestrator's suites need this one role on memory backends only, so they keep this
//! role-local fixture instead of the full in-memory host of `switchboard::testing` (which
//! depends on this crate). Each suite adds its own helpers on top.

#![allow(dead_code)]

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::Bus;
use sb_common::bus::QueueType;
use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, TopologyOptions, declare_topology};
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_orchestrator::OrchestratorDeps;
use sb_orchestrator::access::ExistingResources;
use sb_store::{SqlStore, SqlStoreOptions, Stores};

/// The memory bus, the memory session store and an in-memory SQLite store, with a declared
/// topology.
pub struct MemoryBackends {
    pub bus: Arc<MemoryBus>,
    pub sessions: Arc<MemorySessionStore>,
    pub stores: Stores,
    pub topology: Topology,
}

/// The stores of a migrated SQLite database at `url` (`sqlite::memory:`, or a file).
pub async fn sqlite_stores(url: &str) -> Stores {
    let store = SqlStore::connect(
        url,
        &SqlStoreOptions {
            migrate: true,
            ..Default::default()
        },
    )
    .await
    .expect("sqlite");
    Stores::from_sql(store)
}

/// The stores of a migrated in-memory SQLite database.
pub async fn memory_stores() -> Stores {
    sqlite_stores("sqlite::memory:").await
}

/// A unique name prefix for one test's topology.
pub fn unique_name_prefix() -> String {
    format!("t-{}.switchboard", uuid::Uuid::new_v4().simple())
}

/// The suites' topology: `shards` event and result shards, pool `default`, classic queues,
/// no delivery limit, under a unique prefix.
pub fn sharded_topology(shards: u32) -> TopologyOptions {
    TopologyOptions {
        name_prefix: unique_name_prefix(),
        events_shards: NonZeroU32::new(shards).unwrap(),
        results_shards: NonZeroU32::new(shards).unwrap(),
        pools: vec!["default".into()],
        queue_type: QueueType::Classic,
        delivery_limit: None,
    }
}

/// Declares `options` on `bus`.
pub async fn declare(bus: &dyn Bus, options: &TopologyOptions) -> Topology {
    declare_topology(bus, options).await.expect("topology")
}

/// Fresh memory backends with a [`sharded_topology`] of `shards` shards.
pub async fn memory_backends(shards: u32) -> MemoryBackends {
    let stores = memory_stores().await;
    let bus = Arc::new(MemoryBus::new());
    let topology = declare(bus.as_ref(), &sharded_topology(shards)).await;
    MemoryBackends {
        bus,
        sessions: Arc::new(MemorySessionStore::new()),
        stores,
        topology,
    }
}

/// The orchestrator's dependencies on these backends, with an empty catalog.
pub fn deps(
    bus: Arc<dyn Bus>,
    sessions: Arc<dyn SessionStore>,
    stores: Stores,
    topology: Topology,
) -> OrchestratorDeps {
    OrchestratorDeps {
        bus,
        sessions,
        stores,
        topology,
        catalog: Arc::new(ExistingResources::default()),
    }
}

/// Polls `check` every 10 ms until it holds; panics after 5 s.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}
