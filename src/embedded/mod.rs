//! Builds Switchboard in this process from the configuration and runs the asked roles.
//!
//! `switchboard dev` runs all three roles here on the in-process bus and session store with
//! SQLite; `switchboard gateway|orchestrator|worker` run one role each on RabbitMQ, Redis and
//! Postgres (SPEC §1.1: two deployment modes, one code path). Both go through
//! [`start_with`], and so does the end-to-end harness.
//!
//! # Start
//!
//! ```text
//!  bind the HTTP address (gateway)      fail fast on a taken port, before touching anything
//!  database: connect + migrate          SQLite or Postgres (database.url)
//!  bus: memory | amqp                   + declare the topology (idempotent)
//!  sessions: memory | redis
//!  bootstrap (dev)                      workspace `default`, API key file, see below
//!  worker                               registers its runners before anything is routed
//!  default agent (dev)                  local agent on the dev model, or echo
//!  recovery (memory bus only)           see below
//!  orchestrator, then gateway           consumers first, ingest last
//! ```
//!
//! # Stop ([`Embedded::shutdown`], or the [`Shutdown`] given to [`start_with`])
//!
//! Every role runs on its own [`Shutdown`] so that they stop in pipeline order instead of
//! all at once:
//!
//! 1. **ingest**: the gateway stops accepting requests (its outbox relay stops too; rows it
//!    had not published stay in the database and are published at the next start);
//! 2. **accepted work** (all roles in one process on the memory bus): wait until every
//!    accepted event is routed and every job has been taken by the worker, for at most
//!    `worker.drain_timeout`, so work that was waiting for a slot still runs;
//! 3. **worker**: stops taking jobs; the runs in flight get its own drain (drain timeout,
//!    then cancel, then force; see `sb_worker::service`) — each run gets one drain timeout,
//!    not two;
//! 4. **results** (memory bus): wait for the terminal items the worker just published to be
//!    persisted;
//! 5. **orchestrator**, then the bus and the database pool are closed.
//!
//! # Recovery (memory bus)
//!
//! The in-process bus does not outlive the process, so a crash (or a drain cut short) can
//! lose messages that were published but not consumed. The ledger still knows about that
//! work, so at start, before the consumers run, the orchestrator's recovery pass
//! ([`sb_orchestrator::recovery`]) publishes again the events never routed and those whose
//! run never started, and ends the runs this process was executing as `interrupted`. With
//! RabbitMQ nothing is recovered here: the broker keeps unconsumed messages, and the outbox
//! keeps unpublished ones.
//!
//! # Bootstrap (`switchboard dev`)
//!
//! With a [`Bootstrap`], the data directory gets what a first `switchboard send` needs: the
//! workspace `default`, an API key in `<data-dir>/api-key` (mode 0600; created when missing
//! or no longer valid, kept otherwise) and the default agent for `message.received`: the
//! local agent on the model of `dev.model_url` / `dev.model` when one is configured (the
//! model registered, or updated in place), else the echo runner. The agent is created in a
//! workspace without agents and converged at every start while it is still the bootstrap's
//! (see [`crate::default_agent`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, declare_topology};
use sb_common::bus::{Bus, BusError};
use sb_common::config::SwitchboardConfig;
use sb_common::error::ShutdownError;
use sb_common::session::{SessionError, SessionStore};
use sb_common::shutdown::Shutdown;
use sb_gateway::{GatewayDeps, GatewayError, GatewayOptions};
use sb_orchestrator::catalog::StoreCatalog;
use sb_orchestrator::recovery::{self, RecoveryError};
use sb_orchestrator::sink::ResultSink;
use sb_orchestrator::{Orchestrator, OrchestratorDeps, OrchestratorError, OrchestratorOptions};
use sb_protocol::manifest::RunnerId;
use sb_store::{SqlStore, StoreError, Stores};
use sb_worker::{Worker, WorkerDeps, WorkerError, WorkerHandle, WorkerOptions};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::default_agent::{Change, DefaultAgentError};

mod backends;
mod bootstrap;
mod outlet;
mod stop;

pub use backends::{open_sessions, store_options, topology_options};
pub use bootstrap::{API_KEY_FILE, Bootstrap, BootstrapReport};
pub use sb_orchestrator::recovery::{INTERRUPTED_MESSAGE, RecoveryReport};
pub use stop::StopReport;

use backends::{open_bus, open_database};
use bootstrap::bootstrap_key;
use stop::{Parts, stop, supervise};

pub use crate::default_agent::DEFAULT_AGENT_NAME;

/// Which roles run in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// HTTP API, outbox relay, live delivery.
    pub gateway: bool,
    /// Routing, result sink, reaper.
    pub orchestrator: bool,
    /// Runner processes and their Host API.
    pub worker: bool,
}

impl Roles {
    /// All three (`switchboard dev`).
    pub const ALL: Self = Self {
        gateway: true,
        orchestrator: true,
        worker: true,
    };
    /// Only the gateway.
    pub const GATEWAY: Self = Self {
        gateway: true,
        orchestrator: false,
        worker: false,
    };
    /// Only the orchestrator.
    pub const ORCHESTRATOR: Self = Self {
        gateway: false,
        orchestrator: true,
        worker: false,
    };
    /// Only a worker.
    pub const WORKER: Self = Self {
        gateway: false,
        orchestrator: false,
        worker: true,
    };

    /// The role names, for logs and the AMQP connection name (`gateway+worker`).
    #[must_use]
    pub fn names(self) -> String {
        let names: Vec<&str> = [
            (self.gateway, "gateway"),
            (self.orchestrator, "orchestrator"),
            (self.worker, "worker"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join("+")
        }
    }
}

/// What [`start_with`] should set up besides the roles.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// The roles to run.
    pub roles: Roles,
    /// Prepare a data directory for a local user (`switchboard dev`, the test harness).
    pub bootstrap: Option<Bootstrap>,
    /// How the worker finds runner commands and serves their Host API calls.
    pub worker: WorkerOptions,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        Self {
            roles: Roles::ALL,
            bootstrap: None,
            worker: WorkerOptions::default(),
        }
    }
}

impl EmbeddedOptions {
    /// The given roles, no bootstrap, default worker options.
    #[must_use]
    pub fn roles(roles: Roles) -> Self {
        Self {
            roles,
            ..Self::default()
        }
    }
}

/// Why the process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration failed validation.
    #[error("invalid configuration: {0}")]
    Config(#[from] sb_common::config::ConfigError),
    /// The process could not be made non-dumpable (SECURITY.md).
    #[error("cannot harden the process: {0}")]
    Hardening(String),
    /// The HTTP address cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The database cannot be opened or migrated.
    #[error("cannot open the database {url}: {source}")]
    Database {
        /// The URL, password redacted.
        url: String,
        /// Why.
        source: StoreError,
    },
    /// A store operation of the bootstrap or the recovery failed.
    #[error("database error during {during}: {source}")]
    Store {
        /// Which step.
        during: &'static str,
        /// Why.
        source: StoreError,
    },
    /// The bus cannot be reached or its topology declared.
    #[error("message bus: {0}")]
    Bus(#[from] BusError),
    /// The session store cannot be reached.
    #[error("session store: {0}")]
    Sessions(#[from] SessionError),
    /// The model of `dev.model_url` cannot be registered (refused by the egress policy or
    /// `secrets.allow`).
    #[error("dev model: {0}")]
    DevModel(String),
    /// The data directory or the API key file cannot be written.
    #[error("data directory {}: {source}", .path.display())]
    DataDir {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The worker did not start.
    #[error("worker: {0}")]
    Worker(#[from] WorkerError),
    /// The orchestrator did not start, or the recovery failed.
    #[error("orchestrator: {0}")]
    Orchestrator(#[from] OrchestratorError),
    /// Shutdown began before the start completed.
    #[error(transparent)]
    Shutdown(#[from] ShutdownError),
}

impl From<RecoveryError> for StartError {
    /// A failed store operation is a failed step of the start ("database error during the
    /// recovery"); the bus's and the orchestrator's errors are reported as theirs.
    fn from(error: RecoveryError) -> Self {
        match error {
            RecoveryError::Store(source) => Self::Store {
                during: "the recovery",
                source,
            },
            RecoveryError::Bus(error) => Self::Bus(error),
            RecoveryError::Orchestrator(error) => Self::Orchestrator(error),
        }
    }
}

/// A running Switchboard process (some or all roles). Stop it with [`Embedded::shutdown`],
/// or trigger the [`Shutdown`] given to [`start_with`] and [`Embedded::wait`] for the stop.
/// Dropping it without stopping triggers the stop in the background.
pub struct Embedded {
    trigger: Shutdown,
    config: Arc<SwitchboardConfig>,
    roles: Roles,
    http_addr: Option<SocketAddr>,
    stores: Stores,
    bus: Arc<dyn Bus>,
    sessions: Arc<dyn SessionStore>,
    topology: Topology,
    bootstrap: Option<BootstrapReport>,
    recovery: RecoveryReport,
    worker_id: Option<String>,
    runners: Vec<RunnerId>,
    stopped: Option<JoinHandle<StopReport>>,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("roles", &self.roles)
            .field("http_addr", &self.http_addr)
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl Embedded {
    /// The address the gateway listens on (the bound one: `127.0.0.1:0` becomes a real port),
    /// `None` without the gateway role.
    #[must_use]
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// `http://<http_addr>`, `None` without the gateway role.
    #[must_use]
    pub fn base_url(&self) -> Option<String> {
        self.http_addr.map(|addr| format!("http://{addr}"))
    }

    /// The API key of workspace `default`, when a bootstrap ran.
    #[must_use]
    pub fn api_key(&self) -> Option<&str> {
        self.bootstrap.as_ref().map(|b| b.api_key.as_str())
    }

    /// What the bootstrap did, when one ran.
    #[must_use]
    pub fn bootstrap(&self) -> Option<&BootstrapReport> {
        self.bootstrap.as_ref()
    }

    /// What the recovery pass at start did.
    #[must_use]
    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The configuration in use.
    #[must_use]
    pub fn config(&self) -> &SwitchboardConfig {
        &self.config
    }

    /// The roles running here.
    #[must_use]
    pub fn roles(&self) -> Roles {
        self.roles
    }

    /// The stores (the database every role uses).
    #[must_use]
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    /// The bus.
    #[must_use]
    pub fn bus(&self) -> &Arc<dyn Bus> {
        &self.bus
    }

    /// The session store.
    #[must_use]
    pub fn sessions(&self) -> &Arc<dyn SessionStore> {
        &self.sessions
    }

    /// Exchange and queue names.
    #[must_use]
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The worker's id, with the worker role.
    #[must_use]
    pub fn worker_id(&self) -> Option<&str> {
        self.worker_id.as_deref()
    }

    /// The runners the worker hosts (and registered), with the worker role.
    #[must_use]
    pub fn runners(&self) -> &[RunnerId] {
        &self.runners
    }

    /// Stops the process in pipeline order (see the module docs) and returns what the stop
    /// did. Completes when every role has stopped and the bus and database are closed.
    pub async fn shutdown(mut self) -> StopReport {
        self.trigger.trigger();
        self.join_stop().await
    }

    /// Waits until the process has stopped: after the [`Shutdown`] given to [`start_with`]
    /// was triggered (ctrl-c, SIGTERM) and the drain finished, or after a role failed.
    pub async fn wait(mut self) -> StopReport {
        self.join_stop().await
    }

    async fn join_stop(&mut self) -> StopReport {
        match self.stopped.take() {
            Some(handle) => handle.await.unwrap_or_else(|error| StopReport {
                failure: Some(format!("the stop sequence failed: {error}")),
                ..StopReport::default()
            }),
            None => StopReport::default(),
        }
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        // A forgotten (or panicking) owner must not leave runner processes behind: start the
        // stop; the background task finishes it while the runtime lives.
        if self.stopped.is_some() {
            self.trigger.trigger();
        }
    }
}

/// Starts every role ([`Roles::ALL`]) with no bootstrap. See [`start_with`].
pub async fn start(config: SwitchboardConfig, shutdown: Shutdown) -> Result<Embedded, StartError> {
    start_with(config, EmbeddedOptions::default(), shutdown).await
}

/// Validates `config`, builds the dependencies, and starts `options.roles` (see the module
/// docs for the order). `shutdown` is the process's trigger (the CLI connects it to ctrl-c
/// and SIGTERM): once it fires, the roles stop in order; [`Embedded::wait`] returns when they
/// have.
pub async fn start_with(
    config: SwitchboardConfig,
    options: EmbeddedOptions,
    shutdown: Shutdown,
) -> Result<Embedded, StartError> {
    config.validate()?;
    // Every role holds credentials (database, bus, session store): no process of the same
    // user, a runner included, may read them from `/proc/<pid>/environ` or attach to us.
    // The worker does this too (it is a library); here it covers a lone gateway or
    // orchestrator as well.
    sb_worker::runner::make_undumpable().map_err(|e| StartError::Hardening(e.to_string()))?;
    if shutdown.is_shutting_down() {
        return Err(ShutdownError {
            task: "switchboard".into(),
        }
        .into());
    }
    let config = Arc::new(config);
    let roles = options.roles;

    let listener = if roles.gateway {
        let addr = config.gateway.http_addr;
        Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?,
        )
    } else {
        None
    };
    let http_addr = match &listener {
        Some(l) => Some(l.local_addr().map_err(|source| StartError::Listen {
            addr: config.gateway.http_addr,
            source,
        })?),
        None => None,
    };

    // A process without the API still answers /metrics, /healthz and /readyz when asked to.
    let ops_listener = match config.telemetry.metrics_listen.filter(|_| !roles.gateway) {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?,
        ),
        None => None,
    };

    let sql = open_database(&config).await?;
    let stores = Stores::from_sql(sql.clone());
    let (bus, memory_bus) = open_bus(&config, roles).await?;
    let sessions = open_sessions(&config).await?;
    let topology = declare_topology(bus.as_ref(), &topology_options(&config)?).await?;

    let mut started = Started::default();
    let result = start_roles(
        &config,
        options,
        listener,
        Deps {
            stores: stores.clone(),
            bus: bus.clone(),
            memory_bus: memory_bus.clone(),
            sessions: sessions.clone(),
            topology: topology.clone(),
        },
        &mut started,
    )
    .await;
    let (bootstrap, recovery) = match result {
        Ok(done) => done,
        Err(error) => {
            tracing::error!(%error, "start failed; stopping what was started");
            let parts = started.into_parts(&config, roles, &sql, &bus, &memory_bus, &topology);
            let _ = stop(parts, None).await;
            return Err(error);
        }
    };

    let worker_id = started.worker.as_ref().map(|w| w.handle.id().to_owned());
    let runners = started
        .worker
        .as_ref()
        .map(|w| w.handle.runners().to_vec())
        .unwrap_or_default();
    let parts = started.into_parts(&config, roles, &sql, &bus, &memory_bus, &topology);
    let trigger = shutdown.clone();
    if let Some(listener) = ops_listener {
        let probes = sb_gateway::ops::Probes {
            database: stores.health.clone(),
            bus: bus.clone(),
            sessions: sessions.clone(),
            timeout: READINESS_TIMEOUT,
        };
        if let Ok(addr) = listener.local_addr() {
            // The marker and `url` field are what test harnesses look for (like "gateway ready").
            tracing::info!(url = %format!("http://{addr}"), "metrics ready: /metrics, /healthz, /readyz");
        }
        // Stops with the process trigger: nothing to drain, and a scrape during the stop
        // sequence still answers until then.
        let _ = trigger.spawn(
            "metrics",
            sb_gateway::ops::serve(listener, probes, trigger.clone()),
        );
    }
    let stopped = tokio::spawn(supervise(parts, trigger.clone()));
    tracing::info!(roles = %roles.names(), http_addr = ?http_addr, "switchboard started");

    Ok(Embedded {
        trigger,
        config,
        roles,
        http_addr,
        stores,
        bus,
        sessions,
        topology,
        bootstrap,
        recovery,
        worker_id,
        runners,
        stopped: Some(stopped),
    })
}

/// How long each `/readyz` probe of an orchestrator or worker process may take (the
/// gateway's is `GatewayOptions::readiness_timeout`, the same value).
const READINESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The shared dependencies of the roles.
struct Deps {
    stores: Stores,
    bus: Arc<dyn Bus>,
    memory_bus: Option<MemoryBus>,
    sessions: Arc<dyn SessionStore>,
    topology: Topology,
}

/// A started gateway: its own shutdown and its server task.
struct GatewayRole {
    shutdown: Shutdown,
    /// `None` once the supervisor has seen it end.
    task: Option<JoinHandle<Result<(), GatewayError>>>,
}

struct OrchestratorRole {
    shutdown: Shutdown,
    orchestrator: Orchestrator,
}

struct WorkerRole {
    shutdown: Shutdown,
    handle: WorkerHandle,
}

/// The roles started so far (so a failed start can stop them).
#[derive(Default)]
struct Started {
    gateway: Option<GatewayRole>,
    orchestrator: Option<OrchestratorRole>,
    worker: Option<WorkerRole>,
}

impl Started {
    fn into_parts(
        self,
        config: &Arc<SwitchboardConfig>,
        roles: Roles,
        sql: &SqlStore,
        bus: &Arc<dyn Bus>,
        memory_bus: &Option<MemoryBus>,
        topology: &Topology,
    ) -> Parts {
        Parts {
            config: Arc::clone(config),
            roles,
            sql: sql.clone(),
            bus: Arc::clone(bus),
            memory_bus: memory_bus.clone(),
            topology: topology.clone(),
            gateway: self.gateway,
            orchestrator: self.orchestrator,
            worker: self.worker,
        }
    }
}

async fn start_roles(
    config: &Arc<SwitchboardConfig>,
    options: EmbeddedOptions,
    listener: Option<TcpListener>,
    deps: Deps,
    started: &mut Started,
) -> Result<(Option<BootstrapReport>, RecoveryReport), StartError> {
    let roles = options.roles;
    let mut bootstrap = match &options.bootstrap {
        Some(b) => Some(bootstrap_key(&deps.stores, &b.data_dir).await?),
        None => None,
    };

    let orchestrator_deps = OrchestratorDeps {
        bus: deps.bus.clone(),
        sessions: deps.sessions.clone(),
        stores: deps.stores.clone(),
        topology: deps.topology.clone(),
        // Models, tools and knowledge bases registered through `/v1/models`, `/v1/tools`
        // and `/v1/knowledge-bases`.
        catalog: Arc::new(StoreCatalog::new(deps.stores.resources.clone())),
    };
    let orchestrator_options = OrchestratorOptions::from_config(config);

    // The worker registers its runners before anything can be routed to them. On RabbitMQ
    // its runs' items go straight to a result sink of this process (`outlet`) instead of
    // through the results queue, a confirmed quorum-queue write and a delivery per batch
    // saved. On the in-process bus that hop is a channel, and the orchestrator's sink
    // consuming it costs less (measured: the embedded host was 9–20 % slower at 64 runs in
    // flight with the worker storing its items itself), so there the items take it.
    if roles.worker {
        let shutdown = Shutdown::new();
        let worker_deps = WorkerDeps {
            bus: deps.bus.clone(),
            sessions: deps.sessions.clone(),
            stores: deps.stores.clone(),
            config: Arc::clone(config),
            topology: deps.topology.clone(),
        };
        let mut worker_options = options.worker.clone();
        if worker_options.outlet.is_none() && deps.memory_bus.is_none() {
            let sink = ResultSink::new(
                orchestrator_deps.clone(),
                Arc::new(orchestrator_options.clone()),
            );
            worker_options.outlet = Some(Arc::new(outlet::SinkOutlet::new(sink)));
        }
        let handle = Worker::spawn_with(worker_deps, worker_options, shutdown.clone()).await?;
        started.worker = Some(WorkerRole { shutdown, handle });
    }

    if let (Some(report), Some(b)) = (bootstrap.as_mut(), &options.bootstrap) {
        if b.default_agent {
            let agent = crate::default_agent::ensure(&deps.stores, config)
                .await
                .map_err(|e| match e {
                    DefaultAgentError::Refused(why) => StartError::DevModel(why),
                    DefaultAgentError::Store(source) => StartError::Store {
                        during: "the default agent",
                        source,
                    },
                })?;
            if agent.change != Change::Unchanged {
                if let Err(error) =
                    sb_common::session::announce_routing_change(deps.sessions.as_ref()).await
                {
                    tracing::warn!(%error, "could not announce the default agent to the routing caches");
                }
            }
            report.default_agent = agent.agent_id.filter(|_| agent.change == Change::Created);
            report.agent = Some(agent);
        }
    }

    let mut recovery = RecoveryReport::default();
    if roles.orchestrator && deps.memory_bus.is_some() {
        recovery =
            recovery::recover(&orchestrator_deps, &Arc::new(orchestrator_options.clone())).await?;
    }

    if roles.orchestrator {
        let shutdown = Shutdown::new();
        let orchestrator =
            Orchestrator::spawn(orchestrator_deps, orchestrator_options, &shutdown).await?;
        started.orchestrator = Some(OrchestratorRole {
            shutdown,
            orchestrator,
        });
    }

    if let Some(listener) = listener {
        let shutdown = Shutdown::new();
        let gateway_deps = GatewayDeps {
            stores: deps.stores.clone(),
            bus: deps.bus.clone(),
            sessions: deps.sessions.clone(),
            topology: deps.topology.clone(),
        };
        let task = shutdown.spawn(
            "gateway",
            sb_gateway::serve(
                listener,
                gateway_deps,
                GatewayOptions::from_config(config),
                shutdown.clone(),
            ),
        )?;
        started.gateway = Some(GatewayRole {
            shutdown,
            task: Some(task),
        });
    }
    Ok((bootstrap, recovery))
}

#[cfg(test)]
mod tests;
