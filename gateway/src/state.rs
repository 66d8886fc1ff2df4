//! [`AppState`]: what every handler can reach, and [`GatewayOptions`]: the gateway's tuning,
//! derived from the configuration.
//!
//! Every dependency comes in through [`GatewayDeps`] as a trait object (`Arc<dyn Bus>`,
//! store traits, `Arc<dyn SessionStore>`), so tests run the real handlers on the memory bus,
//! the memory session store and SQLite.

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus, BusError};
use sb_common::config::SwitchboardConfig;
use sb_common::session::SessionStore;
use sb_common::shutdown::Shutdown;
use sb_host_api::actions::{ActionDispatcher, ActionLimits};
use sb_host_api::api::HostApi;
use sb_host_api::api_gate::ApiGate;
use sb_host_api::providers::ProviderOptions;
use sb_store::Stores;

use crate::auth::{AuthOptions, KeyCache};
use crate::ingest::IngestWriter;
use crate::limits::{KeyLimitOptions, KeyLimits};
use crate::live::LiveHub;
use crate::normalize::NormalizeLimits;
use crate::relay::{RelayHandle, RelayOptions};
use crate::stream::{RoutePace, StreamContext, StreamOptions};

/// The gateway's tuning.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Id of this gateway process; names its exclusive delivery queue.
    pub gateway_id: String,
    /// Largest request body, in bytes (`413` above).
    pub max_body_bytes: usize,
    /// Largest artifact `POST /v1/artifacts` takes, decoded bytes (`limits.artifact_upload_bytes`);
    /// that route's body limit is derived from it instead of `max_body_bytes`.
    pub artifact_upload_bytes: usize,
    /// Time limit of a non-streaming request (`504 deadline_exceeded` after).
    pub request_timeout: Duration,
    /// Ingest normalization limits.
    pub normalize: NormalizeLimits,
    /// Result streams.
    pub stream: StreamOptions,
    /// Outbox relay.
    pub relay: RelayOptions,
    /// Page size when the client gives none.
    pub page_size_default: u64,
    /// Largest page size (requested limits are clamped to `[1, max]`).
    pub page_size_max: u64,
    /// Unacked live deliveries the gateway's queue consumer may hold.
    pub delivery_prefetch: u16,
    /// Time allowed to each dependency check of `/readyz`.
    pub readiness_timeout: Duration,
    /// Longest `timeout_ms` of an HTTP tool registration (`limits.tool_timeout_max`).
    pub tool_timeout_max: Duration,
    /// Largest `max_response_bytes` of an HTTP tool registration
    /// (`limits.tool_response_bytes_max`).
    pub tool_response_bytes_max: u64,
    /// Limits of the remote Host API (`POST /v1/host/{action}`): the workers' own, from the
    /// same `[limits]` section, so a call is judged alike whichever way it arrives.
    pub host_api: ActionLimits,
    /// Timeouts and retries of the model calls served by the remote Host API: the workers'
    /// own, from the same `[providers]` section.
    pub providers: ProviderOptions,
    /// The API key cache (`gateway.key_cache_entries`).
    pub auth: AuthOptions,
    /// How far in the future `deliver_at` may be (`limits.deliver_at_max_delay`).
    pub deliver_at_max_delay: Duration,
    /// Per-key request rate and open streams (`limits.requests_per_second_per_key`,
    /// `limits.requests_burst_per_key`, `limits.streams_per_key`).
    pub key_limits: KeyLimitOptions,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self::from_config(&SwitchboardConfig::default())
    }
}

impl GatewayOptions {
    /// Options from the validated configuration (`gateway`, `limits` and `providers`
    /// sections).
    pub fn from_config(config: &SwitchboardConfig) -> Self {
        let g = &config.gateway;
        let limits = &config.limits;
        Self {
            gateway_id: format!("gw-{}", uuid::Uuid::now_v7().simple()),
            max_body_bytes: g.max_body_bytes.get(),
            artifact_upload_bytes: limits.artifact_upload_bytes.get(),
            request_timeout: g.request_timeout,
            normalize: NormalizeLimits {
                data_string_bytes: limits.event_data_string_bytes.get(),
                input_summary_chars: limits.input_summary_chars.get(),
            },
            stream: StreamOptions::default(),
            relay: RelayOptions {
                batch: u64::from(g.outbox_batch.get()),
                poll_interval: g.outbox_poll_interval,
                handover_lease: g.outbox_handover_lease,
                mark_delay: g.outbox_mark_delay,
                retry: config.retry.policy(),
                ..RelayOptions::default()
            },
            page_size_default: u64::from(limits.page_size_default.get()),
            page_size_max: u64::from(limits.page_size_max.get()),
            delivery_prefetch: config.bus.prefetch.get(),
            readiness_timeout: Duration::from_secs(2),
            tool_timeout_max: limits.tool_timeout_max,
            tool_response_bytes_max: u64::try_from(limits.tool_response_bytes_max.get())
                .unwrap_or(u64::MAX),
            host_api: ActionLimits::from_config(limits),
            auth: AuthOptions {
                key_cache_entries: g.key_cache_entries,
                ..AuthOptions::default()
            },
            key_limits: KeyLimitOptions::from_config(limits),
            deliver_at_max_delay: limits.deliver_at_max_delay,
            providers: ProviderOptions::of(config),
        }
    }
}

/// The external dependencies of the gateway.
#[derive(Clone)]
pub struct GatewayDeps {
    /// Persistence.
    pub stores: Stores,
    /// The message bus.
    pub bus: Arc<dyn Bus>,
    /// The active-run session store: readiness, the cancel flag, and the run sessions the
    /// remote Host API is checked against.
    pub sessions: Arc<dyn SessionStore>,
    /// Exchange names and shard counts.
    pub topology: Topology,
}

/// Shared state of the handlers. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    deps: GatewayDeps,
    options: GatewayOptions,
    live: LiveHub,
    route_pace: RoutePace,
    relay: RelayHandle,
    ingest: IngestWriter,
    shutdown: Shutdown,
    host_api: Arc<dyn HostApi>,
    keys: KeyCache,
    key_limits: KeyLimits,
}

impl AppState {
    /// Builds the state and starts the live-delivery hub (declares this gateway's exclusive
    /// delivery queue). The outbox relay is started by [`crate::run`] (or by a test) with
    /// [`AppState::relay`]; ingest hands it rows or wakes it.
    pub async fn new(
        deps: GatewayDeps,
        options: GatewayOptions,
        shutdown: Shutdown,
    ) -> Result<Self, BusError> {
        let queue = deps.topology.deliveries_queue(&options.gateway_id);
        let exchange = deps.topology.deliveries_exchange();
        let live = LiveHub::start(
            Arc::clone(&deps.bus),
            queue,
            exchange,
            options.delivery_prefetch,
            shutdown.token(),
        )
        .await?;
        let dispatcher = ActionDispatcher::new(
            deps.stores.clone(),
            Arc::clone(&deps.sessions),
            options.host_api.clone(),
        )
        .with_provider_options(options.providers.clone());
        let host_api: Arc<dyn HostApi> =
            Arc::new(ApiGate::new(Arc::clone(&deps.sessions), dispatcher));
        let keys = KeyCache::new(options.auth);
        let key_limits = KeyLimits::new(options.key_limits);
        let relay = RelayHandle::new();
        let ingest = IngestWriter::start(
            Arc::clone(&deps.stores.events),
            relay.clone(),
            options.relay.handover_lease,
        );
        Ok(Self {
            inner: Arc::new(Inner {
                deps,
                options,
                live,
                route_pace: RoutePace::default(),
                relay,
                ingest,
                shutdown,
                host_api,
                keys,
                key_limits,
            }),
        })
    }

    /// Persistence.
    pub fn stores(&self) -> &Stores {
        &self.inner.deps.stores
    }

    /// The bus.
    pub fn bus(&self) -> &Arc<dyn Bus> {
        &self.inner.deps.bus
    }

    /// The session store.
    pub fn sessions(&self) -> &Arc<dyn SessionStore> {
        &self.inner.deps.sessions
    }

    /// Exchange names and shard counts.
    pub fn topology(&self) -> &Topology {
        &self.inner.deps.topology
    }

    /// Tuning.
    pub fn options(&self) -> &GatewayOptions {
        &self.inner.options
    }

    /// The live-delivery hub.
    pub fn live(&self) -> &LiveHub {
        &self.inner.live
    }

    /// Wakes the outbox relay and hands it leased rows.
    pub fn relay(&self) -> &RelayHandle {
        &self.inner.relay
    }

    /// The ingest's group commit (`POST /v1/events`).
    pub fn ingest(&self) -> &IngestWriter {
        &self.inner.ingest
    }

    /// The Host API pipeline (gate, then actions) that remote runner calls go through once
    /// their run token is verified.
    pub fn host_api(&self) -> &Arc<dyn HostApi> {
        &self.inner.host_api
    }

    /// The cache of API key lookups (see [`crate::auth`]).
    pub fn keys(&self) -> &KeyCache {
        &self.inner.keys
    }

    /// This process's per-key limiters (see [`crate::limits`]).
    pub fn key_limits(&self) -> &KeyLimits {
        &self.inner.key_limits
    }

    /// Process shutdown.
    pub fn shutdown(&self) -> &Shutdown {
        &self.inner.shutdown
    }

    /// What a result stream needs.
    pub fn stream_context(&self) -> StreamContext {
        StreamContext {
            runs: Arc::clone(&self.stores().runs),
            events: Arc::clone(&self.stores().events),
            live: self.inner.live.clone(),
            route_pace: self.inner.route_pace.clone(),
            options: self.inner.options.stream,
            shutdown: self.inner.shutdown.token(),
        }
    }

    /// Clamps a requested page size to `[1, page_size_max]`.
    pub fn page_limit(&self, requested: Option<u64>) -> u64 {
        requested
            .unwrap_or(self.inner.options.page_size_default)
            .clamp(1, self.inner.options.page_size_max.max(1))
    }
}

impl crate::auth::KeyAuthority for AppState {
    fn keys(&self) -> &KeyCache {
        AppState::keys(self)
    }

    fn tenancy(&self) -> &dyn sb_store::Tenancy {
        self.stores().tenancy.as_ref()
    }

    fn sessions(&self) -> &dyn SessionStore {
        AppState::sessions(self).as_ref()
    }

    fn key_limits(&self) -> &KeyLimits {
        AppState::key_limits(self)
    }
}
