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
//! work, so at start, before the consumers run:
//! - events still `received` (published, never routed) are published again;
//! - runs still `queued` get their event published again: the orchestrator reuses the run
//!   (one run per event) and publishes its job again;
//! - runs still `running` were being executed by this process when it stopped, and no worker
//!   can hold them now: they end `interrupted` with a `run.failed {code: "interrupted"}` item
//!   (SPEC §10.2: an interrupted run is never replayed automatically).
//!
//! Every consumer is idempotent, so a message published twice (by the recovery and by the
//! outbox relay) has no further effect. With RabbitMQ nothing is recovered here: the broker
//! keeps unconsumed messages, and the outbox keeps unpublished ones.
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

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, TopologyOptions, declare_topology};
use sb_common::bus::{Bus, BusError, PublishOptions};
use sb_common::config::{BusKind, QueueType as ConfigQueueType, SessionsKind, SwitchboardConfig};
use sb_common::error::ShutdownError;
use sb_common::session::memory::MemorySessionStore;
use sb_common::session::{SessionError, SessionStore};
use sb_common::shutdown::{DrainReport, Shutdown};
use sb_gateway::{GatewayDeps, GatewayError, GatewayOptions};
use sb_orchestrator::catalog::StoreCatalog;
use sb_orchestrator::sink::ResultSink;
use sb_orchestrator::{Orchestrator, OrchestratorDeps, OrchestratorError, OrchestratorOptions};
use sb_protocol::error::run_failure;
use sb_protocol::ids::{AgentId, EventId, RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::messages::{EventMessage, encode};
use sb_protocol::result::AgentRunResult;
use sb_store::{
    ApiKeyRole, EventRecord, EventStatus, RunOutcome, RunStatus, SqlStore, SqlStoreOptions,
    StoreError, StoreLimits, Stores,
};
use sb_worker::{Worker, WorkerDeps, WorkerError, WorkerHandle, WorkerOptions, WorkerReport};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::default_agent::{Change, DefaultAgentError, DefaultAgentReport};

/// File name of the API key inside the data directory.
pub const API_KEY_FILE: &str = "api-key";
pub use crate::default_agent::DEFAULT_AGENT_NAME;
/// The message of the `run.failed` item of a run that recovery finds still `running`.
pub const INTERRUPTED_MESSAGE: &str =
    "the switchboard process stopped while the run was in progress";

/// Time the gateway gets to finish in-flight requests (streams end at once on shutdown).
const GATEWAY_DRAIN: Duration = Duration::from_secs(10);
/// Time the results of the worker's last runs get to be persisted (step 4 of the stop).
const RESULTS_SETTLE: Duration = Duration::from_secs(10);
/// Time the orchestrator's loops get to finish the message they are handling.
const ORCHESTRATOR_DRAIN: Duration = Duration::from_secs(10);
/// How often the queues are looked at while waiting for the pipeline to go idle.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// Consecutive observations that count as idle (see [`wait_until`]).
const IDLE_CONFIRMATIONS: u32 = 2;

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

/// What the bootstrap of a data directory does (see the module docs).
#[derive(Debug, Clone)]
pub struct Bootstrap {
    /// Where the API key file is kept (created if missing).
    pub data_dir: PathBuf,
    /// Create (or converge) the default agent: the local agent on the `[dev]` model, or
    /// the echo runner.
    pub default_agent: bool,
}

impl Bootstrap {
    /// Bootstrap `data_dir`, with the default agent.
    #[must_use]
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            default_agent: true,
        }
    }
}

/// What the bootstrap found or created.
#[derive(Clone)]
pub struct BootstrapReport {
    /// The API key of workspace `default` (from the key file, or just created).
    pub api_key: String,
    /// `<data-dir>/api-key`.
    pub api_key_file: PathBuf,
    /// `true` when the key was created by this start (show it once).
    pub api_key_created: bool,
    /// The agent created by this start, if any.
    pub default_agent: Option<AgentId>,
    /// The default agent and model after this start (with [`Bootstrap::default_agent`]).
    pub agent: Option<DefaultAgentReport>,
}

impl std::fmt::Debug for BootstrapReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapReport")
            .field("api_key", &"****")
            .field("api_key_file", &self.api_key_file)
            .field("api_key_created", &self.api_key_created)
            .field("default_agent", &self.default_agent)
            .field("agent", &self.agent)
            .finish()
    }
}

/// What the recovery pass at start did (memory bus only; see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Events published again (never routed, or routed to a run that never started).
    pub republished: Vec<EventId>,
    /// Runs that were executing when the process stopped, now `interrupted`.
    pub interrupted: Vec<RunId>,
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

/// How the process stopped.
#[derive(Debug, Default)]
pub struct StopReport {
    /// A role that stopped on its own with an error (the gateway's server failing), which is
    /// what began the stop; `None` for a requested stop.
    pub failure: Option<String>,
    /// Step 2 of the stop: every accepted event was routed and every job taken by the worker
    /// before the drain timeout. `None` when the step does not apply (roles in separate
    /// processes).
    pub work_handed_over: Option<bool>,
    /// What the worker's own drain had to do.
    pub worker: Option<WorkerReport>,
    /// Tasks aborted at a role's drain deadline, as `<role>: <task>`.
    pub forced_tasks: Vec<String>,
}

impl StopReport {
    /// `true` when nothing failed and nothing had to be forced.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.failure.is_none()
            && self.forced_tasks.is_empty()
            && self
                .worker
                .as_ref()
                .is_none_or(|w| w.cancelled_runs.is_empty() && w.forced_runs.is_empty())
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

/// Everything the stop sequence needs.
struct Parts {
    config: Arc<SwitchboardConfig>,
    roles: Roles,
    sql: SqlStore,
    bus: Arc<dyn Bus>,
    memory_bus: Option<MemoryBus>,
    topology: Topology,
    gateway: Option<GatewayRole>,
    orchestrator: Option<OrchestratorRole>,
    worker: Option<WorkerRole>,
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

    // The worker registers its runners before anything can be routed to them.
    if roles.worker {
        let shutdown = Shutdown::new();
        let worker_deps = WorkerDeps {
            bus: deps.bus.clone(),
            sessions: deps.sessions.clone(),
            stores: deps.stores.clone(),
            config: Arc::clone(config),
            topology: deps.topology.clone(),
        };
        let handle =
            Worker::spawn_with(worker_deps, options.worker.clone(), shutdown.clone()).await?;
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

    let mut recovery = RecoveryReport::default();
    if roles.orchestrator && deps.memory_bus.is_some() {
        let sink = ResultSink::new(
            orchestrator_deps.clone(),
            Arc::new(orchestrator_options.clone()),
        );
        recovery = recover(&deps, &sink).await?;
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

/// Waits for the trigger (or a role failing on its own), then runs the stop sequence.
async fn supervise(mut parts: Parts, trigger: Shutdown) -> StopReport {
    let gateway_task = parts.gateway.as_mut().and_then(|g| g.task.as_mut());
    let failure = match gateway_task {
        Some(task) => tokio::select! {
            biased;
            _ = trigger.cancelled() => None,
            result = task => {
                let failure = match result {
                    Ok(Ok(())) => "the gateway stopped unexpectedly".to_owned(),
                    Ok(Err(error)) => format!("the gateway failed: {error}"),
                    Err(error) => format!("the gateway task failed: {error}"),
                };
                tracing::error!(%failure, "stopping the process");
                if let Some(gateway) = parts.gateway.as_mut() {
                    gateway.task = None;
                }
                trigger.trigger();
                Some(failure)
            }
        },
        None => {
            trigger.cancelled().await;
            None
        }
    };
    stop(parts, failure).await
}

/// The stop sequence (module docs, "Stop").
async fn stop(parts: Parts, failure: Option<String>) -> StopReport {
    let mut report = StopReport {
        failure,
        ..StopReport::default()
    };
    tracing::info!(roles = %parts.roles.names(), "stopping");

    // 1. Ingest.
    if let Some(gateway) = parts.gateway {
        let drain = gateway.shutdown.drain(GATEWAY_DRAIN).await;
        note_forced(&mut report, "gateway", &drain);
        if let Some(task) = gateway.task {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "the gateway stopped with an error"),
                Err(error) if error.is_cancelled() => {}
                Err(error) => tracing::warn!(%error, "the gateway task failed"),
            }
        }
        tracing::info!("gateway stopped");
    }

    // 2. Work already accepted: routed, and taken by the worker, while every consumer runs.
    let all_local = parts.worker.is_some() && parts.orchestrator.is_some();
    if let (Some(bus), true) = (&parts.memory_bus, all_local) {
        let budget = parts.config.worker.drain_timeout;
        let backlog = Backlog::of(&parts.topology);
        let handed_over = wait_until(budget, || backlog.count(bus) == 0).await;
        if handed_over {
            tracing::info!("every accepted event was routed and its run started");
        } else {
            tracing::warn!(
                backlog = backlog.count(bus),
                ?budget,
                "events or jobs were still waiting at the drain timeout; they resume at the next start"
            );
        }
        report.work_handed_over = Some(handed_over);
    }

    // 3. The worker: stops taking jobs, drains its runs.
    if let Some(worker) = parts.worker {
        worker.shutdown.trigger();
        let worker_report = worker.handle.join().await;
        if !worker_report.cancelled_runs.is_empty() || !worker_report.forced_runs.is_empty() {
            tracing::warn!(
                cancelled = worker_report.cancelled_runs.len(),
                forced = worker_report.forced_runs.len(),
                "runs were still in flight when the worker stopped"
            );
        }
        let drain = worker.shutdown.drain(Duration::from_secs(2)).await;
        note_forced(&mut report, "worker", &drain);
        report.worker = Some(worker_report);
        tracing::info!("worker stopped");
    }

    // 4. The terminal items the worker just published reach the ledger.
    if let (Some(bus), Some(_)) = (&parts.memory_bus, &parts.orchestrator) {
        let results: Vec<String> = (0..parts.topology.options().results_shards.get())
            .map(|k| parts.topology.results_queue(k).name)
            .collect();
        if !wait_until(RESULTS_SETTLE, || messages(bus, &results, true) == 0).await {
            tracing::warn!(
                pending = messages(bus, &results, true),
                "results were still unpersisted at shutdown; their runs end `interrupted` at the next start"
            );
        }
    }

    // 5. The orchestrator, then the connections.
    if let Some(orchestrator) = parts.orchestrator {
        let drain = orchestrator.shutdown.drain(ORCHESTRATOR_DRAIN).await;
        note_forced(&mut report, "orchestrator", &drain);
        orchestrator.orchestrator.join().await;
        tracing::info!("orchestrator stopped");
    }
    if let Err(error) = parts.bus.close().await {
        tracing::warn!(%error, "closing the bus failed");
    }
    if let Err(error) = parts.sql.close().await {
        tracing::warn!(%error, "closing the database failed");
    }
    tracing::info!("stopped");
    report
}

fn note_forced(report: &mut StopReport, role: &str, drain: &DrainReport) {
    report
        .forced_tasks
        .extend(drain.forced.iter().map(|task| format!("{role}: {task}")));
}

/// Work accepted but not yet started: messages in the events queues (ready, or being
/// routed) and jobs in the runs queues that no worker has taken. A job a worker holds is
/// unacknowledged until its run ends, so it is in flight, not backlog: the worker's own drain
/// owns it.
struct Backlog {
    events: Vec<String>,
    runs: Vec<String>,
}

impl Backlog {
    fn of(topology: &Topology) -> Self {
        let options = topology.options();
        Self {
            events: (0..options.events_shards.get())
                .map(|k| topology.events_queue(k).name)
                .collect(),
            runs: options
                .pools
                .iter()
                .map(|p| topology.runs_queue(p).name)
                .collect(),
        }
    }

    fn count(&self, bus: &MemoryBus) -> usize {
        messages(bus, &self.events, true) + messages(bus, &self.runs, false)
    }
}

/// Messages ready in `queues`, plus the delivered-but-unsettled ones with `unsettled`.
fn messages(bus: &MemoryBus, queues: &[String], unsettled: bool) -> usize {
    queues
        .iter()
        .map(|q| {
            let ready = bus.ready_count(q).unwrap_or(0);
            let unacked = if unsettled {
                bus.unacked_count(q).unwrap_or(0)
            } else {
                0
            };
            ready + unacked
        })
        .sum()
}

/// Polls `done` until it holds on [`IDLE_CONFIRMATIONS`] consecutive looks (a message being
/// handed from one queue to the next is always visible in one of them, but two looks rule
/// out reading mid-hand-over), at most `budget`.
async fn wait_until(budget: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + budget;
    let mut quiet = 0;
    loop {
        if done() {
            quiet += 1;
            if quiet >= IDLE_CONFIRMATIONS {
                return true;
            }
        } else {
            quiet = 0;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(IDLE_POLL).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Dependencies
// ---------------------------------------------------------------------------------------------

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

async fn open_database(config: &SwitchboardConfig) -> Result<SqlStore, StartError> {
    SqlStore::connect(config.database.url.expose(), &store_options(config))
        .await
        .map_err(|source| StartError::Database {
            url: config.database.url.to_string(),
            source,
        })
}

async fn open_bus(
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
            let bus = sb_common::bus::amqp::AmqpBus::connect(
                sb_common::bus::amqp::AmqpOptions::new(url, name),
            )
            .await?;
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

// ---------------------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------------------

/// Workspace `default` and its admin API key: the one in `<data-dir>/api-key` if it still
/// authenticates as an admin key of `default`, else a new one written there (mode 0600). The
/// key is `admin` because it is the operator's: it creates the default agent, and `send`,
/// the README's `curl` examples and `switchboard keys` use it.
async fn bootstrap_key(stores: &Stores, data_dir: &Path) -> Result<BootstrapReport, StartError> {
    let workspace = WorkspaceId::default_workspace();
    let store_err = |source| StartError::Store {
        during: "the bootstrap",
        source,
    };
    stores
        .tenancy
        .ensure_workspace(&workspace)
        .await
        .map_err(store_err)?;
    std::fs::create_dir_all(data_dir).map_err(|source| StartError::DataDir {
        path: data_dir.to_path_buf(),
        source,
    })?;
    let file = data_dir.join(API_KEY_FILE);
    if let Ok(text) = std::fs::read_to_string(&file) {
        let key = text.trim();
        let valid = match stores.tenancy.authenticate(key).await.map_err(store_err)? {
            Some(found) => found.workspace_id == workspace && found.role == ApiKeyRole::Admin,
            None => false,
        };
        if !key.is_empty() && valid {
            return Ok(BootstrapReport {
                api_key: key.to_owned(),
                api_key_file: file,
                api_key_created: false,
                default_agent: None,
                agent: None,
            });
        }
        tracing::warn!(file = %file.display(), "the API key file holds no valid admin key for workspace default; creating a new key");
    }
    let key = stores
        .tenancy
        .create_api_key(&workspace, Some("switchboard dev"), ApiKeyRole::Admin)
        .await
        .map_err(store_err)?;
    write_secret(&file, &key.plaintext).map_err(|source| StartError::DataDir {
        path: file.clone(),
        source,
    })?;
    tracing::info!(key_id = %key.record.id, prefix = %key.record.prefix, file = %file.display(), "API key created");
    Ok(BootstrapReport {
        api_key: key.plaintext,
        api_key_file: file,
        api_key_created: true,
        default_agent: None,
        agent: None,
    })
}

/// Writes `secret` and a newline to `path`, readable by the owner only, replacing the file
/// atomically (a reader never sees a half-written key).
fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        open.mode(0o600);
    }
    let mut file = open.open(&tmp)?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)
}

// ---------------------------------------------------------------------------------------------
// Recovery
// ---------------------------------------------------------------------------------------------

/// How many runs or events the recovery reads per store query: a restart after a long
/// outage can find many, so they are read and handled a page at a time.
const RECOVERY_PAGE: i64 = 100;

/// The recovery pass of the memory bus (module docs, "Recovery").
///
/// Everything it needs is read through the store traits, in pages across all workspaces
/// ([`RunLedger::runs_with_status`](sb_store::RunLedger::runs_with_status),
/// [`EventLog::with_status`](sb_store::EventLog::with_status)). It runs before the
/// orchestrator and the gateway start, so no statuses change under it except its own.
async fn recover(deps: &Deps, sink: &ResultSink) -> Result<RecoveryReport, StartError> {
    let mut report = RecoveryReport::default();
    interrupt_running_runs(deps, sink, &mut report).await?;
    republish_lost_events(deps, &mut report).await?;
    if !report.republished.is_empty() || !report.interrupted.is_empty() {
        tracing::info!(
            republished = report.republished.len(),
            interrupted = report.interrupted.len(),
            "recovered work left by the previous process"
        );
    }
    Ok(report)
}

/// A failed store operation of the recovery.
fn recovery_err(source: StoreError) -> StartError {
    StartError::Store {
        during: "the recovery",
        source,
    }
}

/// Runs that were executing: no worker of this process holds them any more, so they end
/// `interrupted` (each finished as it is read; the store's cursor is a position, so
/// finishing them does not make the next page skip any).
async fn interrupt_running_runs(
    deps: &Deps,
    sink: &ResultSink,
    report: &mut RecoveryReport,
) -> Result<(), StartError> {
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .runs
            .runs_with_status(RunStatus::Running, cursor, Some(RECOVERY_PAGE))
            .await
            .map_err(recovery_err)?;
        for run in page.items {
            let outcome = RunOutcome::with_error(
                RunStatus::Interrupted,
                run_failure::INTERRUPTED,
                INTERRUPTED_MESSAGE,
            );
            let item = AgentRunResult::run_failed(
                run_failure::INTERRUPTED,
                INTERRUPTED_MESSAGE,
                run_failure::default_retryable(run_failure::INTERRUPTED),
            );
            // The item and the status in one commit; a run whose own terminal item was
            // stored ends with that one (exactly one terminal item).
            if sink.finalize(&run, outcome, item).await?.is_none() {
                continue;
            }
            tracing::warn!(run_id = %run.id, "run was in progress when the process stopped; finalized as interrupted");
            report.interrupted.push(run.id);
        }
        let Some(next) = page.next_cursor else {
            return Ok(());
        };
        cursor = Some(next);
    }
}

/// Events never routed, then events whose run never started (their job was lost: the
/// orchestrator reuses the run and publishes its job again). Each event is published once,
/// in that order.
async fn republish_lost_events(deps: &Deps, report: &mut RecoveryReport) -> Result<(), StartError> {
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .events
            .with_status(EventStatus::Received, cursor, Some(RECOVERY_PAGE))
            .await
            .map_err(recovery_err)?;
        for event in &page.items {
            republish(deps, event).await?;
            report.republished.push(event.id);
        }
        let Some(next) = page.next_cursor else {
            break;
        };
        cursor = Some(next);
    }

    // A run is created before its event is marked `dispatched`, so a queued run's event may
    // still be `received`, and published above already.
    let unrouted: HashSet<EventId> = report.republished.iter().copied().collect();
    let mut cursor = None;
    loop {
        let page = deps
            .stores
            .runs
            .runs_with_status(RunStatus::Queued, cursor, Some(RECOVERY_PAGE))
            .await
            .map_err(recovery_err)?;
        for run in &page.items {
            if unrouted.contains(&run.event_id) {
                continue;
            }
            let Some(event) = deps
                .stores
                .events
                .get(run.event_id)
                .await
                .map_err(recovery_err)?
            else {
                continue;
            };
            republish(deps, &event).await?;
            report.republished.push(event.id);
        }
        let Some(next) = page.next_cursor else {
            return Ok(());
        };
        cursor = Some(next);
    }
}

/// Publishes the bus message of `event` again, as the gateway's outbox did the first time.
async fn republish(deps: &Deps, event: &EventRecord) -> Result<(), StartError> {
    let routing_key = deps.topology.events_routing_key(
        event.workspace_id.as_str(),
        event.conversation_id.as_deref(),
    );
    let message = EventMessage::new(event.workspace_id.clone(), event.id);
    deps.bus
        .publish(
            &deps.topology.events_exchange(),
            &routing_key,
            encode(&message).into(),
            PublishOptions::default(),
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names() {
        assert_eq!(Roles::ALL.names(), "gateway+orchestrator+worker");
        assert_eq!(Roles::WORKER.names(), "worker");
        assert_eq!(
            Roles {
                gateway: false,
                orchestrator: false,
                worker: false
            }
            .names(),
            "none"
        );
    }

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

    #[tokio::test]
    async fn backlog_counts_waiting_work_but_not_runs_in_flight() {
        use sb_common::bus::ConsumeOptions;
        let bus = MemoryBus::new();
        let config = SwitchboardConfig::default();
        let topology = declare_topology(&bus, &topology_options(&config).unwrap())
            .await
            .unwrap();
        let backlog = Backlog::of(&topology);
        assert_eq!(backlog.count(&bus), 0);
        assert!(wait_until(Duration::from_secs(1), || backlog.count(&bus) == 0).await);

        let event_key = topology.events_routing_key("default", Some("c1"));
        bus.publish(
            &topology.events_exchange(),
            &event_key,
            "e".into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        bus.publish(
            &topology.runs_exchange(),
            "default",
            "j".into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
        assert_eq!(backlog.count(&bus), 2);

        // An event being routed is still backlog; a job a worker holds is in flight.
        let shard = sb_common::bus::topology::events_shard(
            "default",
            Some("c1"),
            topology.options().events_shards,
        );
        let mut events = bus
            .subscribe(&topology.events_queue(shard), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        let mut jobs = bus
            .subscribe(&topology.runs_queue("default"), ConsumeOptions::prefetch(1))
            .await
            .unwrap();
        let event = events.next().await.unwrap();
        let job = jobs.next().await.unwrap();
        assert_eq!(backlog.count(&bus), 1);
        assert!(!wait_until(Duration::from_millis(100), || backlog.count(&bus) == 0).await);
        event.ack().await.unwrap();
        assert!(wait_until(Duration::from_secs(1), || backlog.count(&bus) == 0).await);
        job.ack().await.unwrap();
    }

    /// A restart after a long outage finds more of each kind of left-over work than one
    /// page holds: every piece is recovered once, in log and ledger order, across
    /// workspaces.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovery_pages_through_everything_an_outage_left() {
        use sb_store::{EventStatusUpdate, NewEvent, NewRun};

        let config = SwitchboardConfig::default();
        let store = SqlStore::connect("sqlite::memory:", &store_options(&config))
            .await
            .unwrap();
        let stores = Stores::from_sql(store);
        let bus = MemoryBus::new();
        let topology = declare_topology(&bus, &topology_options(&config).unwrap())
            .await
            .unwrap();
        let deps = Deps {
            stores: stores.clone(),
            bus: Arc::new(bus.clone()),
            memory_bus: Some(bus.clone()),
            sessions: Arc::new(MemorySessionStore::with_prefix(
                config.sessions.key_prefix.clone(),
            )),
            topology: topology.clone(),
        };
        let sink = ResultSink::new(
            OrchestratorDeps {
                bus: deps.bus.clone(),
                sessions: deps.sessions.clone(),
                stores: stores.clone(),
                topology: topology.clone(),
                catalog: Arc::new(StoreCatalog::new(stores.resources.clone())),
            },
            Arc::new(OrchestratorOptions::from_config(&config)),
        );

        let workspaces = [
            WorkspaceId::default_workspace(),
            WorkspaceId::new("other").unwrap(),
        ];
        let append = |i: usize, status: EventStatus| {
            let mut event = NewEvent::new(workspaces[i % 2].clone(), "message.received", "api");
            event.conversation_id = Some(format!("c{i}"));
            event.status = status;
            let stores = stores.clone();
            async move { stores.events.append(event, Vec::new()).await.unwrap().0 }
        };
        let run_for = |event: &EventRecord| {
            let run = NewRun {
                id: None,
                workspace_id: event.workspace_id.clone(),
                event_id: event.id,
                agent_id: None,
                runner_id: crate::builtin::ECHO_RUNNER_ID.into(),
                pool: "default".into(),
                conversation_id: event.conversation_id.clone(),
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            };
            let stores = stores.clone();
            async move { stores.runs.create_run(run).await.unwrap().0 }
        };
        let dispatch = |event: &EventRecord, run: RunId| {
            let update = EventStatusUpdate {
                run_id: Some(run),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            };
            let (stores, id) = (stores.clone(), event.id);
            async move { stores.events.update_status(id, update).await.unwrap() }
        };

        let more_than_a_page = usize::try_from(RECOVERY_PAGE).unwrap() + 1;
        let (mut never_routed, mut never_started, mut running) =
            (Vec::new(), Vec::new(), Vec::new());
        for i in 0..more_than_a_page {
            never_routed.push(append(i, EventStatus::Received).await.id);

            let event = append(i, EventStatus::Received).await;
            let run = run_for(&event).await;
            dispatch(&event, run.id).await;
            never_started.push(event.id);

            let event = append(i, EventStatus::Received).await;
            let run = run_for(&event).await;
            dispatch(&event, run.id).await;
            assert!(stores.runs.claim_run(run.id, "gone").await.unwrap());
            running.push(run.id);
        }
        // A run created just before the crash, its event not yet marked dispatched: the
        // event is published once, as a received one.
        run_for(&stores.events.get(never_routed[3]).await.unwrap().unwrap()).await;
        // Work that ended, or was never going to run, stays as it is.
        append(0, EventStatus::Unrouted).await;
        let event = append(1, EventStatus::Received).await;
        let done = run_for(&event).await;
        dispatch(&event, done.id).await;
        stores
            .runs
            .finish_run(done.id, RunOutcome::completed())
            .await
            .unwrap();

        let report = recover(&deps, &sink).await.unwrap();
        let expected: Vec<EventId> = never_routed.into_iter().chain(never_started).collect();
        // Counts first: a paging mistake shows as a short (or long) list.
        assert_eq!(report.interrupted.len(), running.len());
        assert_eq!(report.republished.len(), expected.len());
        assert_eq!(report.interrupted, running);
        assert_eq!(report.republished, expected);
        assert_eq!(Backlog::of(&topology).count(&bus), expected.len());
        for run_id in running {
            let run = stores.runs.get_run(run_id).await.unwrap().unwrap();
            assert_eq!(run.status, RunStatus::Interrupted);
            assert_eq!(run.error_code.as_deref(), Some(run_failure::INTERRUPTED));
        }
        let done = stores.runs.get_run(done.id).await.unwrap().unwrap();
        assert_eq!(done.status, RunStatus::Completed);
    }

    /// Issue 15 findings 4 and 6: the recovery ends each run it finds `running` with exactly
    /// one terminal item, stored with the status: its own, if the previous process stored it
    /// before the crash (the run ends with the runner's outcome), else `interrupted` after its
    /// last item.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovery_ends_each_run_with_exactly_one_terminal_item() {
        use sb_store::{EventStatusUpdate, NewEvent, NewRun, NewRunEvent};

        let config = SwitchboardConfig::default();
        let store = SqlStore::connect("sqlite::memory:", &store_options(&config))
            .await
            .unwrap();
        let stores = Stores::from_sql(store);
        let bus = MemoryBus::new();
        let topology = declare_topology(&bus, &topology_options(&config).unwrap())
            .await
            .unwrap();
        let deps = Deps {
            stores: stores.clone(),
            bus: Arc::new(bus.clone()),
            memory_bus: Some(bus.clone()),
            sessions: Arc::new(MemorySessionStore::with_prefix(
                config.sessions.key_prefix.clone(),
            )),
            topology: topology.clone(),
        };
        let sink = ResultSink::new(
            OrchestratorDeps {
                bus: deps.bus.clone(),
                sessions: deps.sessions.clone(),
                stores: stores.clone(),
                topology: topology.clone(),
                catalog: Arc::new(StoreCatalog::new(stores.resources.clone())),
            },
            Arc::new(OrchestratorOptions::from_config(&config)),
        );
        let mut runs = Vec::new();
        for _ in 0..2 {
            let event = NewEvent::new(WorkspaceId::default_workspace(), "message.received", "api");
            let event = stores.events.append(event, Vec::new()).await.unwrap().0;
            let run = NewRun {
                id: None,
                workspace_id: event.workspace_id.clone(),
                event_id: event.id,
                agent_id: None,
                runner_id: crate::builtin::ECHO_RUNNER_ID.into(),
                pool: "default".into(),
                conversation_id: None,
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            };
            let run = stores.runs.create_run(run).await.unwrap().0;
            let update = EventStatusUpdate {
                run_id: Some(run.id),
                ..EventStatusUpdate::status(EventStatus::Dispatched)
            };
            stores.events.update_status(event.id, update).await.unwrap();
            assert!(stores.runs.claim_run(run.id, "gone").await.unwrap());
            runs.push(run.id);
        }
        let item = |run_id, sequence, result_type: &str| NewRunEvent {
            run_id,
            sequence,
            result_type: result_type.to_owned(),
            data: serde_json::json!({"type": result_type, "data": {}}),
        };
        let (partial, finished) = (runs[0], runs[1]);
        stores
            .runs
            .insert_event(item(partial, 1, "message.delta"))
            .await
            .unwrap();
        stores
            .runs
            .insert_event(item(finished, 1, "run.completed"))
            .await
            .unwrap();

        recover(&deps, &sink).await.unwrap();

        let types = |run_id| {
            let stores = stores.clone();
            async move {
                stores
                    .runs
                    .events_after(run_id, 0, 100)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|e| (e.sequence, e.result_type))
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(
            types(partial).await,
            [
                (1, "message.delta".to_owned()),
                (2, "run.failed".to_owned())
            ]
        );
        let run = stores.runs.get_run(partial).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Interrupted);
        assert_eq!(types(finished).await, [(1, "run.completed".to_owned())]);
        let run = stores.runs.get_run(finished).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Completed, "the runner's own outcome");
    }

    #[cfg(unix)]
    #[test]
    fn secrets_are_written_for_the_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(API_KEY_FILE);
        write_secret(&path, "sb_one").unwrap();
        write_secret(&path, "sb_two").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "sb_two\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!path.with_extension("tmp").exists());
    }

    #[tokio::test]
    async fn start_refuses_a_triggered_shutdown_and_a_taken_port() {
        let shutdown = Shutdown::new();
        shutdown.trigger();
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .set("database.url", "sqlite::memory:")
            .load()
            .unwrap();
        assert!(matches!(
            start(config.clone(), shutdown).await,
            Err(StartError::Shutdown(_))
        ));

        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut config = config;
        config.gateway.http_addr = taken.local_addr().unwrap();
        let err = start(config, Shutdown::new()).await.unwrap_err();
        assert!(matches!(err, StartError::Listen { .. }), "{err}");
    }
}
