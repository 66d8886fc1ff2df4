//! The backends every role of a process shares, opened from the configuration: the
//! database (migrated on connect), the bus, the session store and the bus topology.
//!
//! Also what the CLI's other commands open (`switchboard keys revoke` announces revocations
//! to the session store), so a command and a running process agree on every name.

use std::num::NonZeroU32;
use std::sync::Arc;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::TopologyOptions;
use sb_common::bus::{Bus, BusError};
use sb_common::config::{BusKind, QueueType as ConfigQueueType, SessionsKind, SwitchboardConfig};
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_store::{SqlStore, SqlStoreOptions, StoreLimits};

use super::{Roles, StartError};

/// Store options from the configuration (pool, timeouts, value caps); migrations applied on
/// connect, so every role starts on an up-to-date schema (concurrent migrators are
/// serialised by `sb_migrations`).
#[must_use]
pub fn store_options(config: &SwitchboardConfig) -> SqlStoreOptions {
    let db = &config.database;
    let limits = &config.limits;
    SqlStoreOptions {
        max_connections: db.max_connections.get(),
        min_connections: db.min_connections,
        acquire_timeout: db.connect_timeout,
        migrate: true,
        limits: StoreLimits {
            max_state_value_bytes: limits.state_value_bytes.get(),
            max_storage_value_bytes: Some(limits.storage_value_bytes.get()),
            max_artifact_bytes: limits.artifact_read_max_bytes.get(),
        },
        ..SqlStoreOptions::default()
    }
}

pub(super) async fn open_database(config: &SwitchboardConfig) -> Result<SqlStore, StartError> {
    SqlStore::connect(config.database.url.expose(), &store_options(config))
        .await
        .map_err(|source| StartError::Database {
            url: config.database.url.to_string(),
            source,
        })
}

pub(super) async fn open_bus(
    config: &SwitchboardConfig,
    roles: Roles,
) -> Result<(Arc<dyn Bus>, Option<MemoryBus>), StartError> {
    match config.bus.kind {
        BusKind::Memory => {
            let bus = MemoryBus::new();
            Ok((Arc::new(bus.clone()), Some(bus)))
        }
        BusKind::Amqp => {
            // Validation guarantees the URL for `amqp`.
            let url = config
                .bus
                .url
                .as_ref()
                .map(|u| u.expose().to_owned())
                .unwrap_or_default();
            let name = format!("switchboard {} (pid {})", roles.names(), std::process::id());
            let options = sb_common::bus::amqp::AmqpOptions {
                reconnect: config.retry.policy(),
                ..sb_common::bus::amqp::AmqpOptions::new(url, name)
            };
            let bus = sb_common::bus::amqp::AmqpBus::connect(options).await?;
            Ok((Arc::new(bus), None))
        }
    }
}

/// The session store the configuration names (memory or Redis). Also what `switchboard keys
/// revoke` on a database announces revocations to.
pub async fn open_sessions(
    config: &SwitchboardConfig,
) -> Result<Arc<dyn SessionStore>, StartError> {
    let sessions = &config.sessions;
    match sessions.kind {
        SessionsKind::Memory => Ok(Arc::new(MemorySessionStore::with_prefix(
            sessions.key_prefix.clone(),
        ))),
        SessionsKind::Redis => {
            // Validation guarantees the URL for `redis`.
            let url = sessions
                .url
                .as_ref()
                .map(|u| u.expose().to_owned())
                .unwrap_or_default();
            let options =
                sb_common::session::redis::RedisOptions::new(url, sessions.key_prefix.clone());
            Ok(Arc::new(
                sb_common::session::redis::RedisSessionStore::connect(&options).await?,
            ))
        }
    }
}

/// The topology the configuration describes (every process of a deployment must agree).
pub fn topology_options(config: &SwitchboardConfig) -> Result<TopologyOptions, BusError> {
    let bus = &config.bus;
    let shards = |n: std::num::NonZeroU16| NonZeroU32::from(n);
    Ok(TopologyOptions {
        name_prefix: bus.name_prefix.clone(),
        events_shards: shards(bus.events_shards),
        results_shards: shards(bus.results_shards),
        pools: config.worker.pools.clone(),
        queue_type: match bus.queue_type {
            ConfigQueueType::Quorum => sb_common::bus::QueueType::Quorum,
            ConfigQueueType::Classic => sb_common::bus::QueueType::Classic,
        },
        delivery_limit: Some(bus.delivery_limit.get()),
    })
}

#[cfg(test)]
mod tests {
    use sb_common::bus::topology::Topology;

    use super::*;
    use crate::embedded::stop::Backlog;

    #[test]
    fn topology_follows_the_configuration() {
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .set("bus.name_prefix", "t1.sb")
            .set("bus.events_shards", "3")
            .set("bus.results_shards", "2")
            .set("bus.queue_type", "classic")
            .set("worker.pools", "default,gpu")
            .load()
            .unwrap();
        let options = topology_options(&config).unwrap();
        let topology = Topology::new(options).unwrap();
        assert_eq!(topology.events_queue(2).name, "t1.sb.events.2");
        assert_eq!(topology.runs_queue("gpu").name, "t1.sb.runs.gpu");
        let backlog = Backlog::of(&topology);
        assert_eq!((backlog.events.len(), backlog.runs.len()), (3, 2));
        assert_eq!(
            topology.options().queue_type,
            sb_common::bus::QueueType::Classic
        );
    }
}
