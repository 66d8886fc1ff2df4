//! The configuration tree of every Switchboard role, its loader and its validation.
//!
//! One tree ([`SwitchboardConfig`]) serves every role: `switchboard dev` runs all roles in one
//! process from one tree, and a cluster deployment gives every process the same file and
//! environment, so the roles can never disagree about shared values (shard counts, name
//! prefixes, limits).
//!
//! # Loading
//!
//! [`ConfigLoader`] merges, each layer overriding the previous one:
//!
//! 1. built-in defaults (the `impl Default` of every section; they describe the embedded mode:
//!    SQLite under `./.switchboard`, in-process bus and session store);
//! 2. a TOML file: the path given explicitly (`--config FILE`, must exist), or else
//!    `./switchboard.toml` when present;
//! 3. environment variables `SWITCHBOARD__<SECTION>__<KEY>` (`__` separates path segments, so
//!    `SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL=1s` sets `worker.heartbeat_interval`);
//!    list values (`worker.pools`, `worker.runners_dirs`) may be given comma-separated;
//! 4. overrides built by the CLI from its flags (`(key, value)` pairs with dotted keys).
//!
//! The result is then checked by [`SwitchboardConfig::validate`], **before** any connection
//! is opened, so a typo in a URL fails at start-up with the offending key named instead of as
//! a connection error minutes later. Unknown keys are rejected in every layer
//! (`deny_unknown_fields`), so a misspelt variable cannot be silently ignored.
//!
//! The environment is passed to the loader as a map ([`ConfigLoader::env`]), which keeps the
//! loader a pure function of its inputs and lets tests exercise every precedence rule.
//!
//! # Secrets
//!
//! Connection URLs are [`SecretUrl`]s: their `Debug`/`Display` print the password as `****`, so
//! logging a configuration (`debug!(?config)`) never leaks credentials.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU16, NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use url::Url;

/// Prefix of the environment variables read by the loader (followed by `__`).
pub const ENV_PREFIX: &str = "SWITCHBOARD";
/// Separator between path segments in environment variable names.
pub const ENV_SEPARATOR: &str = "__";
/// File read when no explicit `--config` is given, relative to the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "switchboard.toml";

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

/// Shorthand for non-zero literals in `Default` impls; a zero is a bug caught by the tests.
fn nz32(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).expect("default must be non-zero")
}
fn nz16(v: u16) -> NonZeroU16 {
    NonZeroU16::new(v).expect("default must be non-zero")
}
fn nzu(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).expect("default must be non-zero")
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a configuration could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer could not be read or merged, or a value has the wrong type (the message names
    /// the key and the source).
    #[error("cannot load configuration: {0}")]
    Load(#[from] config::ConfigError),
    /// The explicit `--config` file does not exist.
    #[error("configuration file {} does not exist", .0.display())]
    MissingFile(PathBuf),
    /// The merged configuration violates one or more rules; every problem is listed.
    #[error("invalid configuration: {}", format_problems(.0))]
    Invalid(Vec<ConfigProblem>),
}

impl ConfigError {
    /// The validation problems, empty for load errors.
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            Self::Invalid(problems) => problems,
            _ => &[],
        }
    }
}

fn format_problems(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One rejected value: the dotted key and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Dotted path of the offending key, e.g. `bus.url`.
    pub key: String,
    /// What is wrong, phrased as what was expected (lowercase, no trailing period).
    pub reason: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

// ---------------------------------------------------------------------------------------------
// SecretUrl
// ---------------------------------------------------------------------------------------------

/// A connection URL that may carry credentials.
///
/// The original text is kept verbatim (drivers get exactly what the operator wrote) and is only
/// reachable through [`SecretUrl::expose`]. `Debug` and `Display` replace the password with
/// `****`, e.g. `postgres://user:****@host/db`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a URL; it is checked by [`SwitchboardConfig::validate`], not here.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The full URL including credentials. Use it only to open a connection.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Parses the URL.
    pub fn parse(&self) -> Result<Url, url::ParseError> {
        Url::parse(&self.0)
    }

    /// The scheme (`postgres`, `amqp`, …), or `None` if the text is not a URL.
    pub fn scheme(&self) -> Option<String> {
        self.parse().ok().map(|u| u.scheme().to_owned())
    }

    /// The URL with the password replaced by `****`; unparsable text is hidden entirely
    /// because we cannot tell where a password would be.
    pub fn redacted(&self) -> String {
        match self.parse() {
            Ok(mut url) => {
                if url.password().is_some() {
                    // Cannot fail: a URL with a password has a host.
                    let _ = url.set_password(Some("****"));
                }
                url.to_string()
            }
            Err(_) => "<unparsable url>".to_owned(),
        }
    }
}

impl From<&str> for SecretUrl {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for SecretUrl {
    fn from(s: String) -> Self {
        Self::new(s)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({:?})", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

// ---------------------------------------------------------------------------------------------
// The tree
// ---------------------------------------------------------------------------------------------

/// Configuration of every role. Sections that a role does not use are still validated, so one
/// file can be shared by every process of a deployment.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwitchboardConfig {
    /// The ledger database (event log, runs, transcript, artifacts, state, keys).
    pub database: DatabaseConfig,
    /// The message bus between the roles.
    pub bus: BusConfig,
    /// The active-run session store (frozen authorization, leases, steering, budgets).
    pub sessions: SessionsConfig,
    /// The HTTP gateway.
    pub gateway: GatewayConfig,
    /// The orchestrator (routing, result sink, reaper).
    pub orchestrator: OrchestratorConfig,
    /// The worker (runner processes and their Host API).
    pub worker: WorkerConfig,
    /// The model providers behind the Host API's model actions (workers and the gateway's
    /// remote Host API).
    pub providers: ProvidersConfig,
    /// Limits enforced on runners and API clients (SPEC §13).
    pub limits: LimitsConfig,
    /// What the orchestrators' retention task deletes, and when (SPEC §9).
    pub retention: RetentionConfig,
    /// The secrets tenants may reference from models and tools (SPEC §14).
    pub secrets: SecretsConfig,
    /// Where models and tools may be reached (SPEC §14).
    pub egress: EgressConfig,
    /// What `switchboard dev` sets up in workspace `default` (ignored by the role commands).
    pub dev: DevConfig,
    /// Logging.
    pub telemetry: TelemetryConfig,
}

/// Where the ledger lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Database URL: `postgres://user:password@host:5432/db` (also `postgresql://`) or
    /// `sqlite://path/to/file.db?mode=rwc` (`mode=rwc` creates the file if it is missing).
    /// Default: a SQLite file in `./.switchboard`, the embedded mode's data directory.
    pub url: SecretUrl,
    /// Largest number of pooled connections per process.
    pub max_connections: NonZeroU32,
    /// Connections kept open while idle; at most `max_connections`.
    pub min_connections: u32,
    /// How long to wait for a new connection before reporting the database unavailable,
    /// e.g. `5s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            // Embedded mode needs no external service; `mode=rwc` creates the file on first run.
            url: SecretUrl::new("sqlite://.switchboard/switchboard.db?mode=rwc"),
            // Every role does short transactions; 10 covers a gateway's burst of ingest
            // transactions plus the outbox relay without exhausting Postgres's default 100
            // connections when a handful of processes share one server.
            max_connections: nz32(10),
            // One warm connection hides the connect latency of the first request.
            min_connections: 1,
            // Long enough for a TLS handshake to a remote server, short enough that readiness
            // reports a dead database within one probe period.
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Which bus implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BusKind {
    /// In-process bus: only for a single process (`switchboard dev`, tests).
    Memory,
    /// RabbitMQ (AMQP 0.9.1); required when roles run in separate processes.
    Amqp,
}

/// RabbitMQ queue type for durable queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// Replicated, and honours `x-delivery-limit` so poison messages are dead-lettered.
    Quorum,
    /// Single-node queues; lighter, for brokers without quorum-queue support.
    Classic,
}

/// The message bus.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusConfig {
    /// `memory` (single process) or `amqp` (RabbitMQ).
    pub kind: BusKind,
    /// Broker URL, required for `kind = "amqp"`: `amqp://user:password@host:5672/%2f`
    /// (`amqps://` for TLS).
    pub url: Option<SecretUrl>,
    /// Type of the durable queues (`quorum` or `classic`).
    pub queue_type: QueueType,
    /// How many times a message may be returned to its queue (nacked, or its consumer lost)
    /// before it is dead-lettered to `<name_prefix>.dead`: RabbitMQ's `x-delivery-limit`, so a
    /// message gets at most `delivery_limit + 1` delivery attempts (quorum queues, and the
    /// memory bus).
    pub delivery_limit: NonZeroU32,
    /// Number of event shards. Events of one conversation always land on the same shard, and
    /// each shard has a single active consumer, so this bounds how many orchestrators route in
    /// parallel. Every process of a deployment must use the same value.
    pub events_shards: NonZeroU16,
    /// Number of result shards (by run id); same rules as `events_shards`.
    pub results_shards: NonZeroU16,
    /// Unacknowledged messages a consumer may hold (orchestrator and gateway consumers;
    /// workers use `worker.slots`).
    pub prefetch: NonZeroU16,
    /// Prefix of every exchange and queue name (`<prefix>.events`, …). Tests use a unique
    /// prefix to share one broker.
    pub name_prefix: String,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            // The default is the embedded mode; cluster deployments set `amqp`.
            kind: BusKind::Memory,
            url: None,
            // SPEC §3: quorum in cluster mode, because only quorum queues enforce a delivery
            // limit and survive a broker node loss.
            queue_type: QueueType::Quorum,
            // Enough for transient failures (a crashed consumer, a DB blip) to be retried, few
            // enough that a poison message is parked within seconds.
            delivery_limit: nz32(5),
            // Up to 8 orchestrators route/sink in parallel; more shards cost idle queues.
            events_shards: nz16(8),
            results_shards: nz16(8),
            // Keeps a consumer busy across one round trip to the database without letting a
            // single process hoard a shard's backlog.
            prefetch: nz16(64),
            name_prefix: "switchboard".to_owned(),
        }
    }
}

/// Which session-store implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionsKind {
    /// In-process store: only for a single process.
    Memory,
    /// Redis; required when roles run in separate processes.
    Redis,
}

/// The active-run session store.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsConfig {
    /// `memory` (single process) or `redis`.
    pub kind: SessionsKind,
    /// Redis URL, required for `kind = "redis"`: `redis://[:password@]host:6379[/db]`
    /// (`rediss://` for TLS).
    pub url: Option<SecretUrl>,
    /// Prefix of every key written, so several deployments (or tests) can share one Redis.
    pub key_prefix: String,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            kind: SessionsKind::Memory,
            url: None,
            key_prefix: "sb:".to_owned(),
        }
    }
}

/// The HTTP gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the HTTP API listens on, e.g. `0.0.0.0:8080`.
    pub http_addr: SocketAddr,
    /// Largest accepted request body in bytes; larger requests get `413 payload_too_large`
    /// before the body is buffered. Bigger files go through `POST /v1/artifacts`.
    pub max_body_bytes: NonZeroUsize,
    /// Time limit for one request (streams excluded), e.g. `30s`.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How often the outbox relay looks for events that were committed but not yet published
    /// (after a broker outage, or written by another gateway). Events ingested by this process
    /// are relayed immediately, not on this timer.
    #[serde(with = "humantime_serde")]
    pub outbox_poll_interval: Duration,
    /// Outbox rows published per relay round.
    pub outbox_batch: NonZeroU32,
    /// API key lookups kept in memory (least recently used dropped first), so an
    /// authenticated request costs no database query; a revocation still takes effect on
    /// the next request on every gateway (see `sb_gateway::auth`).
    pub key_cache_entries: NonZeroUsize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            // Loopback: the embedded mode must not expose an API to the network by accident.
            http_addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            // The largest thing a JSON request legitimately carries is one inline artifact
            // (SPEC §13: 1 MiB).
            max_body_bytes: nzu(MIB),
            // Well above any non-streaming handler (they do a few DB queries), low enough that a
            // stuck dependency frees the connection.
            request_timeout: Duration::from_secs(30),
            // Only the recovery path waits for this timer; 500 ms bounds the extra latency after
            // an outage without polling the database hot.
            outbox_poll_interval: Duration::from_millis(500),
            // One round drains a typical backlog in a few confirms without a huge transaction.
            outbox_batch: nz32(100),
            // A few hundred bytes each: 10 000 keys cost a few MiB and cover any deployment
            // we know of; a miss is one indexed query.
            key_cache_entries: nzu(10_000),
        }
    }
}

/// The orchestrator.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrchestratorConfig {
    /// Run timeout used when the agent's `runner_config.timeout` is absent, e.g. `300s`.
    #[serde(with = "humantime_serde")]
    pub default_run_timeout: Duration,
    /// Extra time the reaper gives a run past its deadline, or a worker past its lease expiry,
    /// before finalizing the run itself (`timeout` / `interrupted`). It covers the worker's own
    /// cancel grace and the result's trip through the bus.
    #[serde(with = "humantime_serde")]
    pub lease_grace: Duration,
    /// How often the reaper scans for overdue runs and expired leases.
    #[serde(with = "humantime_serde")]
    pub reaper_interval: Duration,
    /// How often the scheduler looks for due schedules and fires them: a schedule fires up
    /// to this long after its time.
    #[serde(with = "humantime_serde")]
    pub scheduler_interval: Duration,
    /// How often an orchestrator renews its entry in the member registry and rebalances the
    /// event and result shards; a joining orchestrator gets its share within this long.
    #[serde(with = "humantime_serde")]
    pub membership_heartbeat: Duration,
    /// How long an orchestrator stays a member after its last renewal: the shards of one
    /// that died move to the others within this plus one heartbeat. Must exceed
    /// `membership_heartbeat`.
    #[serde(with = "humantime_serde")]
    pub membership_ttl: Duration,
    /// This orchestrator's id in the member registry. Unset: unique per process start.
    /// Two running orchestrators must never share an id.
    pub member_id: Option<String>,
    /// Longest the orchestrator routes with a cached read of a workspace's agents or a
    /// runner's descriptor. Changes through the API and worker registrations reach every
    /// orchestrator at once (they announce a new routing epoch); this bounds only changes
    /// made directly in the database. `0s` turns the cache off.
    #[serde(with = "humantime_serde")]
    pub route_cache_max_age: Duration,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            // Seed host behaviour: `DEFAULT_RUNNER_TIMEOUT_SECONDS = 300`.
            default_run_timeout: Duration::from_secs(300),
            // Worker cancel grace (5 s) plus a generous margin for publish + sink.
            lease_grace: Duration::from_secs(15),
            // A stuck run is noticed within deadline + grace + 5 s; the scan is one indexed query.
            reaper_interval: Duration::from_secs(5),
            // Schedules fire within a second of their time; the scan is one indexed query.
            scheduler_interval: Duration::from_secs(1),
            // Two missed renewals are tolerated before a member is presumed dead.
            membership_heartbeat: Duration::from_secs(2),
            membership_ttl: Duration::from_secs(6),
            member_id: None,
            // Routing reads agents and runners on every event; they change rarely.
            route_cache_max_age: Duration::from_secs(30),
        }
    }
}

/// The worker.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Stable identity of this worker in leases and logs. Unset: a random id is generated at
    /// start (see [`WorkerConfig::id_or_generate`]).
    pub id: Option<String>,
    /// Pools this worker consumes jobs from (`switchboard.runs.<pool>`); a runner's manifest
    /// names its pool. Comma-separated in the environment.
    #[serde(deserialize_with = "string_or_seq")]
    pub pools: Vec<String>,
    /// Runs executed concurrently by this worker (also its job prefetch).
    pub slots: NonZeroU32,
    /// Directories scanned for runner plugins (each subdirectory with a `manifest.toml`,
    /// `.yaml` or `.json`). Comma-separated in the environment.
    #[serde(deserialize_with = "string_or_seq")]
    pub runners_dirs: Vec<PathBuf>,
    /// How often a running job's lease is renewed. Must be shorter than `lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// How long a lease lives without renewal; after that the run counts as orphaned and is
    /// finalized `interrupted`.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// Longest line a runner may write on stdout, in bytes; a longer line is a protocol error.
    pub max_line_bytes: NonZeroUsize,
    /// Largest single result (`AgentRunResult` JSON) in bytes; must be below `max_line_bytes`.
    pub max_result_bytes: NonZeroUsize,
    /// Longest runner stderr line copied into the logs, in bytes; the rest of the line is cut.
    pub stderr_cap_bytes: NonZeroUsize,
    /// Time a runner gets after a `cancel` before its process group is killed.
    #[serde(with = "humantime_serde")]
    pub cancel_grace: Duration,
    /// On shutdown, time in-flight runs get to finish before they are cancelled and their jobs
    /// handed back to the queue.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// How runner processes are confined (SPEC §14).
    pub sandbox: SandboxConfig,
}

/// How a worker confines its runner processes (SPEC §14, `SECURITY.md`). Whatever is set
/// here, the worker makes itself non-dumpable at start, so no runner can read its memory or
/// `/proc/<worker>/environ`, and every runner gets a cleared environment, its own process
/// group, `no_new_privs`, the resource limits below and a private temporary directory.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// User the runners run as when the worker can switch users (it runs as root). Unset:
    /// `nobody`. A worker that cannot switch runs them as its own user.
    pub user: Option<String>,
    /// Allow runners to run as root (`user = "root"`, or a root worker that cannot find the
    /// user). Off: such a start is refused.
    pub allow_root: bool,
    /// CPU time one runner process may use (`RLIMIT_CPU`), e.g. `1h`; a shared process
    /// that reaches it is restarted like any crashed one. Unset: no limit.
    #[serde(with = "humantime_serde")]
    pub cpu_time: Option<Duration>,
    /// Address space of one runner process in bytes (`RLIMIT_AS`). Unset: no limit.
    pub memory_bytes: Option<u64>,
    /// Open files of one runner process (`RLIMIT_NOFILE`).
    pub open_files: NonZeroU32,
    /// Processes and threads of the runner user (`RLIMIT_NPROC`).
    pub processes: NonZeroU32,
    /// Directory under which each runner process gets its private temporary directory
    /// (`TMPDIR`), removed when the process exits. Unset: the system's.
    pub temp_root: Option<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            user: None,
            allow_root: false,
            cpu_time: None,
            // 8 GiB of address space: far above an agent loop's needs, yet a runaway
            // allocation fails in the runner instead of pushing the worker's host into swap.
            memory_bytes: Some(8 * 1024 * 1024 * 1024),
            // Enough for an HTTP client pool and a few files; a descriptor leak fails fast.
            open_files: nz32(1024),
            // Threads count: a tokio or Python runner uses tens; 512 stops a fork bomb.
            processes: nz32(512),
            temp_root: None,
        }
    }
}

impl WorkerConfig {
    /// The configured id, or a fresh `worker-<uuid>` (call once at start and keep the result).
    pub fn id_or_generate(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("worker-{}", uuid::Uuid::new_v4().simple()))
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: None,
            pools: vec!["default".to_owned()],
            // Runner processes are mostly waiting on models and tools; 16 concurrent runs keep
            // a small host busy without oversubscribing it with per-run processes.
            slots: nz32(16),
            // The official runners shipped in the repository / image.
            runners_dirs: vec![PathBuf::from("runners")],
            // SPEC §11: heartbeat every 3 s, lease 10 s, so two heartbeats may be lost before a
            // healthy worker loses its run.
            heartbeat_interval: Duration::from_secs(3),
            lease_ttl: Duration::from_secs(10),
            // SPEC §4.2: 4 MiB per line leaves room for a 1 MiB result plus escaping.
            max_line_bytes: nzu(4 * MIB),
            // SPEC §13 / seed `MAX_RESULT_SIZE_BYTES`.
            max_result_bytes: nzu(MIB),
            // Enough for a stack trace line; stops a runner from flooding the logs.
            stderr_cap_bytes: nzu(8 * KIB),
            // Cooperative cancel is a message round trip; 5 s is generous for a runner to stop.
            cancel_grace: Duration::from_secs(5),
            // Below the usual 30 s container stop timeout, so leases are released and jobs
            // requeued before the process is killed.
            drain_timeout: Duration::from_secs(20),
            sandbox: SandboxConfig::default(),
        }
    }
}

/// The model providers (OpenAI-compatible chat completions and `/rerank`) called by the
/// model actions of the Host API: `invoke_llm`, `invoke_llm_stream`, `rerank`. Every worker
/// and the gateway's remote Host API use the same values, so a call is served alike whichever
/// way it arrives. HTTP tools are not covered: each registered tool carries its own timeout
/// and response cap, and a tool call is never retried (it may have side effects).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProvidersConfig {
    /// Time limit of one attempt of a non-streaming model call (`invoke_llm`, `rerank`), and
    /// of the wait for a stream's response headers, e.g. `120s`; the run's remaining time
    /// bounds it further. Each retry gets the full limit again, but a retry that could not
    /// start before the run's deadline is not made (`deadline_exceeded`).
    #[serde(with = "humantime_serde")]
    pub model_timeout: Duration,
    /// Longest silence allowed between two chunks of a streamed model answer
    /// (`invoke_llm_stream`), e.g. `60s`. Once open (see `model_timeout`), a stream has no
    /// overall limit besides the run's deadline: it lives as long as it makes progress.
    #[serde(with = "humantime_serde")]
    pub stream_idle_timeout: Duration,
    /// Attempts of a model call, the first one included (`1` = never retry). Only `429`,
    /// `5xx` and connection failures are retried, and a stream only before its first chunk.
    pub max_attempts: NonZeroU32,
    /// Delay before the first retry, doubled for every further one, e.g. `250ms`.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// Largest body of a non-streaming model or rerank answer read, in bytes; a larger one
    /// fails the call with `payload_too_large`.
    pub max_response_bytes: NonZeroUsize,
    /// Time limit of opening a TCP (and TLS) connection to a model or tool provider, e.g.
    /// `10s`. A connection that cannot be opened in time fails the attempt as a retryable
    /// `unavailable`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for ProvidersConfig {
    fn default() -> Self {
        Self {
            // A long non-streaming completion from a large model takes a minute or more;
            // 120 s covers it, and a hung provider is still given up well before the default
            // 300 s run timeout.
            model_timeout: Duration::from_secs(120),
            // Once generating, providers send a chunk every few tokens; a minute of silence
            // still leaves room for a reasoning model's long time to first token.
            stream_idle_timeout: Duration::from_secs(60),
            // Two retries ride out a rate-limit blip or a restarting provider; more would
            // multiply the latency of a provider that is really down (each attempt may take
            // `model_timeout`) and the load on one that is shedding it.
            max_attempts: nz32(3),
            // Retries after 250 ms and 500 ms: invisible beside a model call, yet not an
            // immediate repeat into the overload that caused the `429`/`503`.
            retry_backoff: Duration::from_millis(250),
            // An answer is bounded by the run's output budget (100 000 characters by default,
            // under 1 MiB as JSON); 8 MiB leaves room for provider metadata such as logprobs
            // while bounding the worker memory one call can take.
            max_response_bytes: nzu(8 * MIB),
            // Far above any healthy handshake, even across continents; without it a host
            // that silently drops the attempt holds the call for the whole `model_timeout`.
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Per-run budgets (SPEC §8); agents may override them. Once exhausted a budget stays
/// exhausted for the run (`budget_exceeded`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetsConfig {
    /// Model invocations per run.
    pub max_model_calls: NonZeroU32,
    /// Tool calls per run.
    pub max_tool_calls: NonZeroU32,
    /// Characters of tool results returned to the runner per run.
    pub max_tool_result_chars: NonZeroUsize,
    /// Characters of model output returned to the runner per run.
    pub max_model_output_chars: NonZeroUsize,
}

impl Default for BudgetsConfig {
    fn default() -> Self {
        // SPEC §8 / §13 defaults.
        Self {
            max_model_calls: nz32(16),
            max_tool_calls: nz32(32),
            max_tool_result_chars: nzu(100_000),
            max_model_output_chars: nzu(100_000),
        }
    }
}

/// Limits on what runners and API clients may send or request (SPEC §13).
///
/// Not here: the transcript's searchable text is cut to 4,000 characters by the store
/// (`sb_store::transcript::MAX_TRANSCRIPT_CONTENT_CHARS`, seed behaviour; the full item is
/// kept beside it), an invariant of the stored data rather than a per-deployment setting.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest state value, in bytes of UTF-8 JSON.
    pub state_value_bytes: NonZeroUsize,
    /// Largest plugin/workspace storage value, in bytes.
    pub storage_value_bytes: NonZeroUsize,
    /// Largest inline artifact content (`artifact.created.content_base64`), decoded bytes.
    pub artifact_inline_bytes: NonZeroUsize,
    /// Bytes returned by an artifact read that gives no `limit`.
    pub artifact_read_default_bytes: NonZeroUsize,
    /// Upper cap on any artifact read `limit`.
    pub artifact_read_max_bytes: NonZeroUsize,
    /// Largest artifact `POST /v1/artifacts` accepts, decoded bytes (`413` above). At most
    /// `artifact_read_max_bytes`, which is also the store's cap on any artifact.
    pub artifact_upload_bytes: NonZeroUsize,
    /// Default page size for history and event pages.
    pub page_size_default: NonZeroU32,
    /// Default page size for state listings.
    pub state_page_size_default: NonZeroU32,
    /// Largest page size (requested limits are clamped to `[1, page_size_max]`); also caps
    /// history search `top_k`.
    pub page_size_max: NonZeroU32,
    /// Steering items queued per run; a full queue sends the event to normal dispatch.
    pub steering_queue_items: NonZeroU32,
    /// Most steering items returned by one pull.
    pub steering_pull_max: NonZeroU32,
    /// Event input summary length, in characters.
    pub input_summary_chars: NonZeroUsize,
    /// Longest string kept in an event's `data`, in UTF-8 bytes (larger → use an artifact).
    pub event_data_string_bytes: NonZeroUsize,
    /// Most documents per rerank call (`invoke_rerank`); a call with more is refused with
    /// `invalid_argument` naming this limit.
    pub rerank_documents_max: NonZeroU32,
    /// Host API calls a run may make per second (token bucket refill); unset disables the
    /// per-run rate limit.
    pub proxy_calls_per_second: Option<NonZeroU32>,
    /// Host API calls a run may make in a burst (token bucket size).
    pub proxy_calls_burst: NonZeroU32,
    /// Longest `timeout_ms` an HTTP tool may be registered with (`POST /v1/tools` refuses
    /// more), and the most one call waits at execution whatever the tool was registered
    /// with: a call holds a worker's attention (and the run's slot) for that long. Whole
    /// milliseconds, at least `1ms`.
    #[serde(with = "humantime_serde")]
    pub tool_timeout_max: Duration,
    /// Largest `max_response_bytes` an HTTP tool may be registered with, and the most of a
    /// tool's answer a worker buffers at execution whatever the tool was registered with.
    pub tool_response_bytes_max: NonZeroUsize,
    /// `/v1` requests one API key may make per second (token bucket refill); more are
    /// refused with `429 rate_limited` and `Retry-After`. Unset disables the limit.
    pub requests_per_second_per_key: Option<NonZeroU32>,
    /// `/v1` requests one API key may make in a burst (token bucket size).
    pub requests_burst_per_key: NonZeroU32,
    /// Result streams (SSE) one API key may hold open at once; one more is refused with
    /// `429 rate_limited`.
    pub streams_per_key: NonZeroU32,
    /// Most result items one run may produce, its terminal item included. A runner that keeps
    /// streaming past `run_items_max - 1` items has its run ended with `run.failed`
    /// (`runner.too_many_items`); a terminal item within the limit is still accepted.
    pub run_items_max: NonZeroU64,
    /// How far in the future `deliver_at` on `POST /v1/events` may be (`400` beyond). A
    /// delayed event waits in the event log, so keep this below the event log's retention.
    #[serde(with = "humantime_serde")]
    pub deliver_at_max_delay: Duration,
    /// Longest a run without a deadline may stay active (`queued` or `running`), from its
    /// creation: the orchestrator's reaper then finalizes it as `timeout`. Runs with a
    /// deadline end at their deadline; this bounds the others, so no run lives forever.
    #[serde(with = "humantime_serde")]
    pub run_max_duration: Duration,
    /// Per-run budgets.
    pub budgets: BudgetsConfig,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        // Values from SPEC §13, which follow the seed host (host-behaviour §1).
        Self {
            state_value_bytes: nzu(256 * KIB),
            storage_value_bytes: nzu(10 * MIB),
            artifact_inline_bytes: nzu(MIB),
            artifact_read_default_bytes: nzu(MIB),
            artifact_read_max_bytes: nzu(10 * MIB),
            // As much as the store keeps: an uploaded artifact is read back in ranges.
            artifact_upload_bytes: nzu(10 * MIB),
            page_size_default: nz32(50),
            state_page_size_default: nz32(100),
            page_size_max: nz32(100),
            steering_queue_items: nz32(100),
            steering_pull_max: nz32(100),
            input_summary_chars: nzu(1000),
            event_data_string_bytes: nzu(512),
            rerank_documents_max: nz32(64),
            // Budgets bound the expensive calls; the rate limit only stops a runner stuck in a
            // tight loop of cheap calls from saturating the worker. 100/s with a 200 burst is
            // far above any legitimate agent loop.
            proxy_calls_per_second: Some(nz32(100)),
            proxy_calls_burst: nz32(200),
            // The bounds `/v1/tools` enforced before they were configurable, so tools
            // registered then stay within them. Two minutes matches `providers.model_timeout`,
            // the other external call of a run; 16 MiB is twice `providers.max_response_bytes`
            // (a tool may return a document), while the default `max_tool_result_chars`
            // budget already refuses answers far smaller than either.
            tool_timeout_max: Duration::from_secs(120),
            tool_response_bytes_max: nzu(16 * MIB),
            // Far above what one client of a 2-core host can use (every request is a
            // database transaction or a stream), so only a runaway or hostile client meets it;
            // the burst absorbs a client's reconnect storm.
            requests_per_second_per_key: Some(nz32(2_000)),
            requests_burst_per_key: nz32(4_000),
            // Each stream holds a connection and a bus subscription; 1 000 per key covers a
            // busy chat front end while one key cannot exhaust a gateway's file descriptors.
            streams_per_key: nz32(1_000),
            // A long streamed answer is a few thousand deltas; 10 000 leaves room for the
            // longest legitimate run while one runaway runner cannot fill the ledger.
            run_items_max: NonZeroU64::new(10_000).expect("non-zero"),
            // A week covers reminders and follow-ups while staying well inside the event
            // log's 30-day retention, so a delayed event is never deleted before it is due.
            deliver_at_max_delay: Duration::from_secs(7 * 24 * 3600),
            // A day: far above any interactive run, and as long as the orchestrator keeps the
            // session of a run without a deadline.
            run_max_duration: Duration::from_secs(24 * 3600),
            budgets: BudgetsConfig::default(),
        }
    }
}

/// What the retention task deletes, and when (SPEC §9, seed 004). One orchestrator at a
/// time runs it (a lease in the session store); every pass deletes in bounded batches, so
/// a backlog (a first start on an old database, a lowered window) drains over several
/// passes instead of holding the database in one long transaction.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// Whether the task runs at all. Off, nothing is ever deleted.
    pub enabled: bool,
    /// How often a pass runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Most rows one delete statement removes (runs, for `run_results`).
    pub batch_size: NonZeroU32,
    /// Most batches of one kind a pass runs; what is left waits for the next pass.
    pub max_batches_per_pass: NonZeroU32,
    /// How long after a run ends its result items (and so its result body) are kept. Past
    /// it the run and its turn answer `expired: true` (`result_expired`); the run is never
    /// re-run.
    #[serde(with = "humantime_serde")]
    pub run_results: Duration,
    /// How long the event log keeps an event (idempotency keys of `POST /v1/events` are
    /// forgotten with it).
    #[serde(with = "humantime_serde")]
    pub event_log: Duration,
    /// How long the transcript (conversation history, history search) keeps an item.
    #[serde(with = "humantime_serde")]
    pub transcript: Duration,
    /// How long a published outbox row is kept after its publication.
    #[serde(with = "humantime_serde")]
    pub outbox_published: Duration,
    /// How long the turn identities (idempotency keys) of a closed session are kept after
    /// it was closed; a session that is not closed keeps them.
    #[serde(with = "humantime_serde")]
    pub closed_session_identities: Duration,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        Self {
            enabled: true,
            // Retention is not latency-sensitive; a minute keeps the task's load negligible.
            interval: Duration::from_secs(60),
            // Each batch is one short transaction; 500 is also the store's largest `IN` list.
            batch_size: nz32(500),
            // Up to 10 000 rows of each kind per pass: far above a steady state, while a
            // backlog cannot keep the database busy for long at a time.
            max_batches_per_pass: nz32(20),
            // Seed 004: result bodies and events are kept at most 24 hours.
            run_results: Duration::from_secs(DAY),
            // SPEC §9: event log and transcript 30 days.
            event_log: Duration::from_secs(30 * DAY),
            transcript: Duration::from_secs(30 * DAY),
            // Issue 14 groups published outbox rows with the event log.
            outbox_published: Duration::from_secs(30 * DAY),
            // Seed 004: identities of closed sessions go 7 days after the close.
            closed_session_identities: Duration::from_secs(7 * DAY),
        }
    }
}

/// The secrets a tenant may reference (SPEC §14): a model's `api_key_env` and a tool's
/// `headers_env` may name only a variable listed here, which the operator set on the workers
/// (and on gateways serving the remote Host API). Registration refuses any other name, and
/// workers check again before reading one, so a key cannot make a worker send its own
/// environment to a URL of the tenant's choosing.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecretsConfig {
    /// Environment variable names, e.g. `OPENAI_API_KEY,TOOL_TOKEN` (comma-separated in the
    /// environment). The host's own `SWITCHBOARD*` variables can never be listed.
    #[serde(deserialize_with = "string_or_seq")]
    pub allow: Vec<String>,
}

/// Where models and tools may be reached (SPEC §14). Outbound calls go only to public
/// addresses unless an entry here allows more: link-local and cloud metadata addresses are
/// denied whatever this says; loopback, private, shared and unspecified ranges are denied
/// unless a CIDR here covers the address or a host name here is the URL's host. The check runs
/// at registration and again on every resolved address at connect time.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EgressConfig {
    /// CIDRs (`127.0.0.0/8`, `10.1.0.0/16`, `::1/128`) or host names (`ollama.internal`),
    /// comma-separated in the environment. `switchboard dev` adds loopback.
    #[serde(deserialize_with = "string_or_seq")]
    pub allow: Vec<String>,
}

/// What `switchboard dev` bootstraps in workspace `default`: with a model (`model_url` and
/// `model`), that OpenAI-compatible model is registered (as the model named `default`,
/// updated in place when these settings change) and the default agent is the local-agent
/// runner bound to it; without one, the default agent is the echo runner. The role commands
/// (`gateway`, `orchestrator`, `worker`) never bootstrap, so they ignore this section: a
/// cluster registers its models and agents through the API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevConfig {
    /// OpenAI-compatible base URL of the model, up to and including the version path:
    /// `http://127.0.0.1:11434/v1` (Ollama), `http://127.0.0.1:8000/v1` (vLLM),
    /// `https://api.openai.com/v1`. `dev` lets models reach loopback; any other private
    /// address needs an `egress.allow` entry.
    pub model_url: Option<String>,
    /// The model's name at that server (`llama3.2`, `gpt-4o-mini`). Required with
    /// `model_url`.
    pub model: Option<String>,
    /// Environment variable holding the server's API key, sent as a bearer token (none for
    /// a local Ollama). `dev` adds it to `secrets.allow`; it may not be a `SWITCHBOARD*`
    /// variable.
    pub model_key_env: Option<String>,
    /// The model's context window in tokens; unset, the local agent assumes 8192 (what
    /// small local models are served with), which only makes it keep less history than
    /// a larger window would allow.
    pub model_context_window: Option<NonZeroU32>,
}

impl DevConfig {
    /// The model to bootstrap, when `model_url` and `model` are both set (validation
    /// refuses one without the other).
    #[must_use]
    pub fn default_model(&self) -> Option<DevModel> {
        let url = self.model_url.as_deref()?.trim();
        let model = self.model.as_deref()?.trim();
        Some(DevModel {
            base_url: url.to_owned(),
            model: model.to_owned(),
            api_key_env: self.model_key_env.clone(),
            context_window: self.model_context_window,
        })
    }
}

/// The model `switchboard dev` registers ([`DevConfig::default_model`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevModel {
    /// OpenAI-compatible base URL.
    pub base_url: String,
    /// Model name at that server.
    pub model: String,
    /// Environment variable of the API key.
    pub api_key_env: Option<String>,
    /// Context window in tokens.
    pub context_window: Option<NonZeroU32>,
}

/// Logging.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Log filter in `tracing` `EnvFilter` syntax, e.g. `info` or `info,sb_worker=debug`.
    /// `RUST_LOG`, when set, takes precedence (the usual Rust convention).
    pub log_level: String,
    /// Write logs as JSON lines (for log shippers) instead of human-readable text.
    pub json: bool,
    /// Where a process without the gateway role (an orchestrator, a worker) serves
    /// `GET /metrics`, `/healthz` and `/readyz`, e.g. `0.0.0.0:9090`. Unset: not served (the
    /// default, so several roles on one host never fight over a port). A gateway serves them
    /// on `gateway.http_addr` and ignores this key.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_level: "info".to_owned(),
            json: false,
            metrics_listen: None,
        }
    }
}

/// Accepts a list, or one comma-separated string (how lists arrive from environment
/// variables). Empty items are dropped.
fn string_or_seq<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: From<String>,
{
    struct Visitor<T>(std::marker::PhantomData<T>);

    impl<'de, T: From<String>> serde::de::Visitor<'de> for Visitor<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of strings or a comma-separated string")
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| T::from(s.to_owned()))
                .collect())
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(item) = seq.next_element::<String>()? {
                out.push(T::from(item));
            }
            Ok(out)
        }
    }

    deserializer.deserialize_any(Visitor(std::marker::PhantomData))
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// Collects problems so that one start-up reports all of them at once.
#[derive(Default)]
struct Problems(Vec<ConfigProblem>);

impl Problems {
    fn push(&mut self, key: &str, reason: impl Into<String>) {
        self.0.push(ConfigProblem {
            key: key.to_owned(),
            reason: reason.into(),
        });
    }

    fn positive(&mut self, key: &str, d: Duration) {
        if d.is_zero() {
            self.push(key, "expected a duration greater than zero");
        }
    }

    /// Checks that `url` parses, has one of `schemes` and, unless `allow_no_host`, a host.
    fn url(&mut self, key: &str, url: &SecretUrl, schemes: &[&str], allow_no_host: bool) {
        let parsed = match url.parse() {
            Ok(u) => u,
            Err(e) => {
                // The text may contain a password: never echo it.
                self.push(key, format!("expected a URL ({e})"));
                return;
            }
        };
        if !schemes.contains(&parsed.scheme()) {
            self.push(
                key,
                format!(
                    "expected a URL with scheme {}, got `{}`",
                    schemes.join(" or "),
                    parsed.scheme()
                ),
            );
            return;
        }
        if !allow_no_host && parsed.host_str().is_none_or(str::is_empty) {
            self.push(key, format!("expected a host in {}", url.redacted()));
        }
    }

    /// Names that become parts of queue names, routing keys or Redis keys.
    fn name(&mut self, key: &str, value: &str, extra: &[char]) {
        let ok = !value.is_empty()
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || extra.contains(&c));
        if !ok {
            let extra: String = extra.iter().collect();
            self.push(
                key,
                format!("expected a non-empty name of [A-Za-z0-9_-{extra}], got `{value}`"),
            );
        }
    }
}

impl SwitchboardConfig {
    /// Checks every rule that can be checked without connecting anywhere. Returns all problems.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        self.validate_database(&mut p);
        self.validate_bus(&mut p);
        self.validate_sessions(&mut p);
        self.validate_gateway(&mut p);
        self.validate_orchestrator(&mut p);
        self.validate_worker(&mut p);
        self.validate_providers(&mut p);
        self.validate_limits(&mut p);
        self.validate_retention(&mut p);
        self.validate_secrets(&mut p);
        self.validate_egress(&mut p);
        self.validate_dev(&mut p);
        self.validate_telemetry(&mut p);
        if p.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(p.0))
        }
    }

    fn validate_database(&self, p: &mut Problems) {
        let db = &self.database;
        match db.url.scheme().as_deref() {
            // `sqlite::memory:` and `sqlite:relative.db` have no host; that is fine.
            Some("sqlite") => p.url("database.url", &db.url, &["sqlite"], true),
            _ => p.url(
                "database.url",
                &db.url,
                &["postgres", "postgresql", "sqlite"],
                false,
            ),
        }
        if db.min_connections > db.max_connections.get() {
            p.push(
                "database.min_connections",
                format!(
                    "expected at most database.max_connections ({}), got {}",
                    db.max_connections, db.min_connections
                ),
            );
        }
        p.positive("database.connect_timeout", db.connect_timeout);
    }

    fn validate_bus(&self, p: &mut Problems) {
        let bus = &self.bus;
        match (&bus.url, bus.kind) {
            (Some(url), _) => p.url("bus.url", url, &["amqp", "amqps"], false),
            (None, BusKind::Amqp) => p.push("bus.url", "required when bus.kind is `amqp`"),
            (None, BusKind::Memory) => {}
        }
        // Dots are allowed (`test.abc`), but not at the ends: names are `<prefix>.<name>`.
        p.name("bus.name_prefix", &bus.name_prefix, &['.']);
        if bus.name_prefix.starts_with('.') || bus.name_prefix.ends_with('.') {
            p.push("bus.name_prefix", "expected no leading or trailing `.`");
        }
    }

    fn validate_sessions(&self, p: &mut Problems) {
        let s = &self.sessions;
        match (&s.url, s.kind) {
            (Some(url), _) => p.url("sessions.url", url, &["redis", "rediss"], false),
            (None, SessionsKind::Redis) => {
                p.push("sessions.url", "required when sessions.kind is `redis`")
            }
            (None, SessionsKind::Memory) => {}
        }
        if s.key_prefix.is_empty() {
            p.push("sessions.key_prefix", "expected a non-empty prefix");
        }
    }

    fn validate_gateway(&self, p: &mut Problems) {
        let g = &self.gateway;
        p.positive("gateway.request_timeout", g.request_timeout);
        p.positive("gateway.outbox_poll_interval", g.outbox_poll_interval);
    }

    fn validate_orchestrator(&self, p: &mut Problems) {
        let o = &self.orchestrator;
        p.positive("orchestrator.default_run_timeout", o.default_run_timeout);
        p.positive("orchestrator.lease_grace", o.lease_grace);
        p.positive("orchestrator.reaper_interval", o.reaper_interval);
        p.positive("orchestrator.scheduler_interval", o.scheduler_interval);
        p.positive("orchestrator.membership_heartbeat", o.membership_heartbeat);
        if o.membership_ttl <= o.membership_heartbeat {
            p.push(
                "orchestrator.membership_ttl",
                "expected a duration greater than orchestrator.membership_heartbeat",
            );
        }
        if let Some(id) = &o.member_id {
            p.name("orchestrator.member_id", id, &['.', ':']);
        }
    }

    fn validate_worker(&self, p: &mut Problems) {
        let w = &self.worker;
        if let Some(id) = &w.id {
            p.name("worker.id", id, &['.', ':']);
        }
        if w.pools.is_empty() {
            p.push("worker.pools", "expected at least one pool");
        }
        for pool in &w.pools {
            // A pool is a routing key and part of a queue name: no dots, no wildcards.
            p.name("worker.pools", pool, &[]);
        }
        if w.runners_dirs.is_empty() {
            p.push("worker.runners_dirs", "expected at least one directory");
        }
        p.positive("worker.heartbeat_interval", w.heartbeat_interval);
        p.positive("worker.lease_ttl", w.lease_ttl);
        if w.heartbeat_interval >= w.lease_ttl {
            p.push(
                "worker.heartbeat_interval",
                format!(
                    "expected less than worker.lease_ttl ({}), got {}",
                    humantime_serde::re::humantime::format_duration(w.lease_ttl),
                    humantime_serde::re::humantime::format_duration(w.heartbeat_interval)
                ),
            );
        }
        if w.max_result_bytes >= w.max_line_bytes {
            p.push(
                "worker.max_result_bytes",
                format!(
                    "expected less than worker.max_line_bytes ({}), got {}",
                    w.max_line_bytes, w.max_result_bytes
                ),
            );
        }
        p.positive("worker.cancel_grace", w.cancel_grace);
        p.positive("worker.drain_timeout", w.drain_timeout);
    }

    fn validate_providers(&self, p: &mut Problems) {
        let pr = &self.providers;
        p.positive("providers.model_timeout", pr.model_timeout);
        p.positive("providers.stream_idle_timeout", pr.stream_idle_timeout);
        p.positive("providers.retry_backoff", pr.retry_backoff);
        p.positive("providers.connect_timeout", pr.connect_timeout);
    }

    fn validate_limits(&self, p: &mut Problems) {
        let l = &self.limits;
        p.positive("limits.deliver_at_max_delay", l.deliver_at_max_delay);
        p.positive("limits.run_max_duration", l.run_max_duration);
        if l.tool_timeout_max < Duration::from_millis(1) {
            // Tool timeouts are whole milliseconds: a smaller ceiling would refuse every tool.
            p.push(
                "limits.tool_timeout_max",
                "expected a duration of at least 1ms",
            );
        }
        if l.artifact_upload_bytes > l.artifact_read_max_bytes {
            p.push(
                "limits.artifact_upload_bytes",
                format!(
                    "expected at most limits.artifact_read_max_bytes ({}), got {}",
                    l.artifact_read_max_bytes, l.artifact_upload_bytes
                ),
            );
        }
        if l.artifact_read_default_bytes > l.artifact_read_max_bytes {
            p.push(
                "limits.artifact_read_default_bytes",
                format!(
                    "expected at most limits.artifact_read_max_bytes ({}), got {}",
                    l.artifact_read_max_bytes, l.artifact_read_default_bytes
                ),
            );
        }
        for (key, value) in [
            ("limits.page_size_default", l.page_size_default),
            ("limits.state_page_size_default", l.state_page_size_default),
        ] {
            if value > l.page_size_max {
                p.push(
                    key,
                    format!(
                        "expected at most limits.page_size_max ({}), got {value}",
                        l.page_size_max
                    ),
                );
            }
        }
    }

    fn validate_retention(&self, p: &mut Problems) {
        let r = &self.retention;
        p.positive("retention.interval", r.interval);
        for (key, value) in [
            ("retention.run_results", r.run_results),
            ("retention.event_log", r.event_log),
            ("retention.transcript", r.transcript),
            ("retention.outbox_published", r.outbox_published),
            (
                "retention.closed_session_identities",
                r.closed_session_identities,
            ),
        ] {
            p.positive(key, value);
        }
    }

    fn validate_secrets(&self, p: &mut Problems) {
        for name in &self.secrets.allow {
            if let Err(e) = crate::secrets::check_allowable(name) {
                p.push("secrets.allow", e.to_string());
            }
        }
    }

    fn validate_egress(&self, p: &mut Problems) {
        for entry in &self.egress.allow {
            if let Err(e) = crate::egress::AllowEntry::parse(entry) {
                p.push("egress.allow", e.to_string());
            }
        }
    }

    fn validate_dev(&self, p: &mut Problems) {
        let d = &self.dev;
        let url = d
            .model_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty());
        let model = d.model.as_deref().map(str::trim).filter(|m| !m.is_empty());
        match (url, model) {
            (Some(_), None) => p.push("dev.model", "required with dev.model_url (--model NAME)"),
            (None, Some(_)) => p.push("dev.model_url", "required with dev.model (--model-url URL)"),
            _ => {}
        }
        if d.model_url.is_some() && url.is_none() {
            p.push("dev.model_url", "expected a URL, got an empty value");
        }
        if d.model.is_some() && model.is_none() {
            p.push("dev.model", "expected a model name, got an empty value");
        }
        if let Some(url) = url {
            match Url::parse(url) {
                Err(e) => p.push("dev.model_url", format!("expected a URL ({e})")),
                Ok(u) if !matches!(u.scheme(), "http" | "https") => p.push(
                    "dev.model_url",
                    format!("expected an http or https URL, got `{}`", u.scheme()),
                ),
                Ok(u) if !u.username().is_empty() || u.password().is_some() => p.push(
                    "dev.model_url",
                    "expected no credentials in the URL (name the key's variable in dev.model_key_env)",
                ),
                Ok(u) if u.host_str().is_none_or(str::is_empty) => {
                    p.push("dev.model_url", "expected a host");
                }
                Ok(_) => {}
            }
        }
        if let Some(name) = &d.model_key_env
            && let Err(e) = crate::secrets::check_allowable(name)
        {
            p.push("dev.model_key_env", e.to_string());
        }
    }

    fn validate_telemetry(&self, p: &mut Problems) {
        if let Err(e) = crate::telemetry::parse_filter(&self.telemetry.log_level) {
            p.push(
                "telemetry.log_level",
                format!("expected a log filter ({e})"),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loader
// ---------------------------------------------------------------------------------------------

/// A value given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OverrideValue {
    /// A scalar; converted to the field's type like any other layer's text.
    Text(String),
    /// A list (repeatable flags such as `--runners-dir`).
    List(Vec<String>),
}

impl From<&str> for OverrideValue {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}

impl From<String> for OverrideValue {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

impl From<Vec<String>> for OverrideValue {
    fn from(v: Vec<String>) -> Self {
        Self::List(v)
    }
}

impl From<OverrideValue> for config::Value {
    fn from(v: OverrideValue) -> Self {
        match v {
            OverrideValue::Text(s) => s.into(),
            OverrideValue::List(items) => items.into(),
        }
    }
}

/// Which file layer to read.
#[derive(Debug, Clone)]
enum FileLayer {
    /// No file at all.
    None,
    /// `<dir>/switchboard.toml` when it exists.
    Discover(PathBuf),
    /// This file; it must exist.
    Explicit(PathBuf),
}

/// Builds a [`SwitchboardConfig`] from defaults, a file, the environment and CLI overrides,
/// then validates it. See the module docs for the precedence.
///
/// ```
/// # use std::collections::HashMap;
/// use sb_common::config::ConfigLoader;
/// let env = HashMap::from([("SWITCHBOARD__WORKER__SLOTS".to_owned(), "4".to_owned())]);
/// let config = ConfigLoader::new()
///     .without_file()
///     .env(env)
///     .set("telemetry.json", "true")
///     .load()
///     .unwrap();
/// assert_eq!(config.worker.slots.get(), 4);
/// assert!(config.telemetry.json);
/// ```
#[derive(Debug, Clone)]
pub struct ConfigLoader {
    file: FileLayer,
    env: BTreeMap<String, String>,
    overrides: Vec<(String, OverrideValue)>,
}

impl Default for ConfigLoader {
    fn default() -> Self {
        Self::new()
    }
}

impl ConfigLoader {
    /// Defaults, plus `./switchboard.toml` if present; no environment until [`Self::env`] or
    /// [`Self::process_env`] is called.
    pub fn new() -> Self {
        Self {
            file: FileLayer::Discover(PathBuf::from(".")),
            env: BTreeMap::new(),
            overrides: Vec::new(),
        }
    }

    /// Reads this file (TOML) instead of discovering `switchboard.toml`; it must exist.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = FileLayer::Explicit(path.into());
        self
    }

    /// Reads `switchboard.toml` from `dir` (if present) instead of the working directory.
    pub fn discover_in(mut self, dir: impl Into<PathBuf>) -> Self {
        self.file = FileLayer::Discover(dir.into());
        self
    }

    /// Reads `path` if `Some`, else discovers `./switchboard.toml` (the `--config` flag).
    pub fn file_opt(self, path: Option<impl Into<PathBuf>>) -> Self {
        match path {
            Some(path) => self.file(path),
            None => self,
        }
    }

    /// Reads no file at all.
    pub fn without_file(mut self) -> Self {
        self.file = FileLayer::None;
        self
    }

    /// Uses these environment variables; only names starting with `SWITCHBOARD__` are read.
    /// Replaces any environment given before.
    pub fn env<K, V>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        self.env = vars
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self
    }

    /// Uses the process environment (non-Unicode variables are skipped).
    pub fn process_env(self) -> Self {
        self.env(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// Adds a CLI override for a dotted key (`gateway.http_addr`); later calls win.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<OverrideValue>) -> Self {
        self.overrides.push((key.into(), value.into()));
        self
    }

    /// Adds several overrides in order.
    pub fn overrides<K, V>(mut self, pairs: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<OverrideValue>,
    {
        for (k, v) in pairs {
            self.overrides.push((k.into(), v.into()));
        }
        self
    }

    /// Merges the layers and validates the result.
    pub fn load(self) -> Result<SwitchboardConfig, ConfigError> {
        let config = self.merge()?;
        config.validate()?;
        Ok(config)
    }

    /// Merges the layers without validating (for tools that print or fix a configuration).
    pub fn merge(self) -> Result<SwitchboardConfig, ConfigError> {
        let mut builder = config::Config::builder();
        match &self.file {
            FileLayer::None => {}
            FileLayer::Discover(dir) => {
                let path = dir.join(DEFAULT_CONFIG_FILE);
                if path.is_file() {
                    builder = builder.add_source(toml_file(&path));
                }
            }
            FileLayer::Explicit(path) => {
                if !path.is_file() {
                    return Err(ConfigError::MissingFile(path.clone()));
                }
                builder = builder.add_source(toml_file(path));
            }
        }
        // Only `SWITCHBOARD__*` names are read (matched case-insensitively by `config`), so
        // `SWITCHBOARD_TEST_DATABASE_URL` and unrelated variables are ignored.
        let env: config::Map<String, String> = self.env.into_iter().collect();
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .separator(ENV_SEPARATOR)
                .source(Some(env)),
        );
        for (key, value) in self.overrides {
            builder = builder.set_override(key, value)?;
        }
        Ok(builder.build()?.try_deserialize()?)
    }
}

fn toml_file(path: &Path) -> config::File<config::FileSourceFile, config::FileFormat> {
    config::File::from(path)
        .format(config::FileFormat::Toml)
        .required(true)
}

/// Convenience used by role binaries: `--config` file (or discovery), the process
/// environment, then the CLI overrides; validated.
pub fn load(
    file: Option<&Path>,
    overrides: impl IntoIterator<Item = (String, OverrideValue)>,
) -> Result<SwitchboardConfig, ConfigError> {
    ConfigLoader::new()
        .file_opt(file)
        .process_env()
        .overrides(overrides)
        .load()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loader() -> ConfigLoader {
        ConfigLoader::new().without_file()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Loads with one override and returns the problems of the validation error.
    fn rejected(key: &str, value: impl Into<OverrideValue>) -> Vec<ConfigProblem> {
        match loader().set(key, value).load() {
            Ok(_) => panic!("{key} should have been rejected"),
            Err(e) => match e {
                ConfigError::Invalid(problems) => problems,
                other => panic!("{key}: expected a validation error, got {other}"),
            },
        }
    }

    fn assert_rejected(key: &str, value: impl Into<OverrideValue>) {
        let problems = rejected(key, value);
        assert!(
            problems.iter().any(|p| p.key == key),
            "expected a problem for {key}, got {problems:?}"
        );
    }

    /// Loads with overrides expecting a type/parse error at load time naming the key.
    fn assert_load_error(key: &str, value: &str) {
        match loader().set(key, value).load() {
            Err(ConfigError::Load(e)) => {
                let msg = e.to_string();
                eprintln!("{key}={value}: {msg}");
                let leaf = key.rsplit('.').next().unwrap();
                assert!(msg.contains(leaf), "error for {key} should name it: {msg}");
            }
            other => panic!("{key}={value}: expected a load error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_embedded() {
        let config = loader().load().expect("defaults must validate");
        assert_eq!(config.bus.kind, BusKind::Memory);
        assert_eq!(config.sessions.kind, SessionsKind::Memory);
        assert_eq!(config.database.url.scheme().as_deref(), Some("sqlite"));
        assert_eq!(config.worker.heartbeat_interval, Duration::from_secs(3));
        assert_eq!(config.worker.lease_ttl, Duration::from_secs(10));
        assert_eq!(config.worker.max_line_bytes.get(), 4 * MIB);
        assert_eq!(config.gateway.max_body_bytes.get(), MIB);
        assert_eq!(config.limits.state_value_bytes.get(), 256 * KIB);
        assert_eq!(config.limits.budgets.max_tool_calls.get(), 32);
        assert_eq!(
            config.orchestrator.default_run_timeout,
            Duration::from_secs(300)
        );
        assert_eq!(config.providers.model_timeout, Duration::from_secs(120));
        assert_eq!(
            config.providers.stream_idle_timeout,
            Duration::from_secs(60)
        );
        assert_eq!(config.providers.max_attempts.get(), 3);
        assert_eq!(config.providers.retry_backoff, Duration::from_millis(250));
        assert_eq!(config.providers.max_response_bytes.get(), 8 * MIB);
        SwitchboardConfig::default().validate().unwrap();
    }

    #[test]
    fn providers_are_set_by_file_environment_and_cli() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("providers.toml");
        std::fs::write(
            &file,
            r#"
            [providers]
            model_timeout = "45s"
            max_attempts = 2
            "#,
        )
        .unwrap();
        let vars = env(&[
            ("SWITCHBOARD__PROVIDERS__MAX_ATTEMPTS", "5"),
            ("SWITCHBOARD__PROVIDERS__STREAM_IDLE_TIMEOUT", "15s"),
            ("SWITCHBOARD__PROVIDERS__RETRY_BACKOFF", "40ms"),
            ("SWITCHBOARD__PROVIDERS__MAX_RESPONSE_BYTES", "65536"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        let p = &c.providers;
        assert_eq!(p.model_timeout, Duration::from_secs(45), "file value kept");
        assert_eq!(p.max_attempts.get(), 5, "environment over file");
        assert_eq!(p.stream_idle_timeout, Duration::from_secs(15));
        assert_eq!(p.retry_backoff, Duration::from_millis(40));
        assert_eq!(p.max_response_bytes.get(), 64 * KIB);

        let c = loader()
            .file(&file)
            .env(vars)
            .set("providers.max_attempts", "1")
            .set("providers.model_timeout", "2m")
            .load()
            .unwrap();
        assert_eq!(c.providers.max_attempts.get(), 1, "CLI over environment");
        assert_eq!(c.providers.model_timeout, Duration::from_secs(120));
        assert_eq!(
            c.providers.retry_backoff,
            Duration::from_millis(40),
            "env value kept"
        );
    }

    #[test]
    fn each_layer_overrides_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("custom.toml");
        std::fs::write(
            &file,
            r#"
            [worker]
            slots = 2
            heartbeat_interval = "2s"
            cancel_grace = "7s"
            [gateway]
            http_addr = "0.0.0.0:9000"
            "#,
        )
        .unwrap();

        // File over defaults.
        let c = loader().file(&file).load().unwrap();
        assert_eq!(c.worker.slots.get(), 2);
        assert_eq!(c.worker.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(c.gateway.http_addr.port(), 9000);
        assert_eq!(
            c.worker.lease_ttl,
            Duration::from_secs(10),
            "untouched default"
        );

        // Environment over file.
        let vars = env(&[
            ("SWITCHBOARD__WORKER__SLOTS", "3"),
            ("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "1s"),
            ("SWITCHBOARD_TEST_DATABASE_URL", "ignored://x"),
            ("PATH", "/bin"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 3);
        assert_eq!(c.worker.heartbeat_interval, Duration::from_secs(1));
        assert_eq!(
            c.worker.cancel_grace,
            Duration::from_secs(7),
            "file value kept"
        );

        // CLI over environment.
        let c = loader()
            .file(&file)
            .env(vars)
            .set("worker.slots", "4")
            .load()
            .unwrap();
        assert_eq!(c.worker.slots.get(), 4);
        assert_eq!(
            c.worker.heartbeat_interval,
            Duration::from_secs(1),
            "env value kept"
        );

        // Later CLI overrides win over earlier ones.
        let c = loader()
            .set("worker.slots", "4")
            .set("worker.slots", "5")
            .load()
            .unwrap();
        assert_eq!(c.worker.slots.get(), 5);
    }

    #[test]
    fn discovers_switchboard_toml_and_explicit_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let c = ConfigLoader::new().discover_in(dir.path()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 16, "no file: defaults");

        std::fs::write(
            dir.path().join(DEFAULT_CONFIG_FILE),
            "[worker]\nslots = 9\n",
        )
        .unwrap();
        let c = ConfigLoader::new().discover_in(dir.path()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 9);

        let missing = dir.path().join("nope.toml");
        assert!(matches!(
            ConfigLoader::new().file(&missing).load(),
            Err(ConfigError::MissingFile(p)) if p == missing
        ));
    }

    #[test]
    fn environment_reaches_every_kind_of_field() {
        let c = loader()
            .env(env(&[
                ("SWITCHBOARD__BUS__KIND", "amqp"),
                (
                    "SWITCHBOARD__BUS__URL",
                    "amqp://guest:guest@rabbitmq:5672/%2f",
                ),
                ("SWITCHBOARD__BUS__QUEUE_TYPE", "classic"),
                ("SWITCHBOARD__SESSIONS__KIND", "redis"),
                ("SWITCHBOARD__SESSIONS__URL", "redis://redis:6379"),
                ("SWITCHBOARD__WORKER__POOLS", "default, gpu"),
                ("SWITCHBOARD__WORKER__RUNNERS_DIRS", "/app/runners,/extra"),
                ("SWITCHBOARD__TELEMETRY__JSON", "true"),
                ("SWITCHBOARD__LIMITS__BUDGETS__MAX_MODEL_CALLS", "3"),
                ("SWITCHBOARD__DATABASE__MIN_CONNECTIONS", "0"),
            ]))
            .load()
            .unwrap();
        assert_eq!(c.bus.kind, BusKind::Amqp);
        assert_eq!(c.bus.queue_type, QueueType::Classic);
        assert_eq!(c.sessions.kind, SessionsKind::Redis);
        assert_eq!(c.worker.pools, vec!["default", "gpu"]);
        assert_eq!(
            c.worker.runners_dirs,
            vec![PathBuf::from("/app/runners"), PathBuf::from("/extra")]
        );
        assert!(c.telemetry.json);
        assert_eq!(c.limits.budgets.max_model_calls.get(), 3);
        assert_eq!(c.database.min_connections, 0);
    }

    #[test]
    fn cli_list_override() {
        let c = loader()
            .set(
                "worker.runners_dirs",
                vec!["a,b".to_owned(), "c".to_owned()],
            )
            .load()
            .unwrap();
        // A list override is taken verbatim: commas inside a path are not split.
        assert_eq!(
            c.worker.runners_dirs,
            vec![PathBuf::from("a,b"), PathBuf::from("c")]
        );
    }

    #[test]
    fn secret_urls_are_redacted_in_debug() {
        let c = loader()
            .set(
                "database.url",
                "postgres://user:hunter2@db.example:5432/ledger",
            )
            .set("bus.url", "amqp://guest:s3cret@rabbit:5672/%2f")
            .set("sessions.url", "redis://:redispw@redis:6379/0")
            .load()
            .unwrap();
        let debug = format!("{c:?}");
        for secret in ["hunter2", "s3cret", "redispw"] {
            assert!(!debug.contains(secret), "{secret} leaked: {debug}");
        }
        assert!(debug.contains("postgres://user:****@db.example:5432/ledger"));
        assert_eq!(
            c.database.url.expose(),
            "postgres://user:hunter2@db.example:5432/ledger"
        );
        assert_eq!(
            SecretUrl::new("not a url with password").to_string(),
            "<unparsable url>"
        );
    }

    #[test]
    fn validation_reports_every_problem() {
        let err = loader()
            .set("bus.kind", "amqp")
            .set("sessions.kind", "redis")
            .load()
            .unwrap_err();
        let keys: Vec<_> = err.problems().iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["bus.url", "sessions.url"]);
        let msg = err.to_string();
        assert!(
            msg.contains("bus.url: required when bus.kind is `amqp`"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_in_every_layer() {
        let err = loader()
            .env(env(&[("SWITCHBOARD__WORKER__SLOTZ", "3")]))
            .load()
            .unwrap_err();
        assert!(err.to_string().contains("slotz"), "{err}");
        let err = loader().set("nosuch.section", "1").load().unwrap_err();
        assert!(err.to_string().contains("nosuch"), "{err}");
    }

    #[test]
    fn accepts_every_documented_url_scheme() {
        for url in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgresql://u:p@db/x",
            "sqlite://.switchboard/switchboard.db?mode=rwc",
            "sqlite::memory:",
            "sqlite:relative.db",
        ] {
            loader()
                .set("database.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        for url in ["amqp://guest:guest@127.0.0.1:5672/%2f", "amqps://h/vhost"] {
            loader()
                .set("bus.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        for url in ["redis://127.0.0.1:6379", "rediss://:pw@h:6380/1"] {
            loader()
                .set("sessions.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    // One test per rejected value.

    #[test]
    fn rejects_database_url_with_unknown_scheme() {
        assert_rejected("database.url", "mysql://root@localhost/db");
    }

    #[test]
    fn rejects_database_url_that_does_not_parse() {
        let problems = rejected("database.url", "postgres//user:pw@host");
        assert_eq!(problems[0].key, "database.url");
        assert!(
            !problems[0].reason.contains("pw"),
            "password echoed: {problems:?}"
        );
    }

    #[test]
    fn rejects_postgres_url_without_host() {
        assert_rejected("database.url", "postgres:///db");
    }

    #[test]
    fn rejects_min_connections_above_max() {
        let err = loader()
            .set("database.max_connections", "2")
            .set("database.min_connections", "3")
            .load()
            .unwrap_err();
        assert_eq!(err.problems()[0].key, "database.min_connections");
    }

    #[test]
    fn rejects_zero_max_connections() {
        assert_load_error("database.max_connections", "0");
    }

    #[test]
    fn rejects_zero_run_items_max() {
        assert_load_error("limits.run_items_max", "0");
    }

    #[test]
    fn rejects_zero_connect_timeout() {
        assert_rejected("database.connect_timeout", "0s");
    }

    #[test]
    fn rejects_duration_without_unit() {
        assert_load_error("database.connect_timeout", "5");
    }

    #[test]
    fn rejects_unknown_bus_kind() {
        assert_load_error("bus.kind", "kafka");
    }

    #[test]
    fn rejects_amqp_bus_without_url() {
        let problems = rejected("bus.kind", "amqp");
        assert_eq!(problems[0].key, "bus.url");
    }

    #[test]
    fn rejects_bus_url_with_wrong_scheme() {
        assert_rejected("bus.url", "http://guest:guest@localhost:5672");
    }

    #[test]
    fn rejects_unknown_queue_type() {
        assert_load_error("bus.queue_type", "stream");
    }

    #[test]
    fn rejects_zero_delivery_limit() {
        assert_load_error("bus.delivery_limit", "0");
    }

    #[test]
    fn rejects_zero_events_shards() {
        assert_load_error("bus.events_shards", "0");
    }

    #[test]
    fn rejects_zero_results_shards() {
        assert_load_error("bus.results_shards", "0");
    }

    #[test]
    fn rejects_zero_prefetch() {
        assert_load_error("bus.prefetch", "0");
    }

    #[test]
    fn rejects_name_prefix_with_wildcards() {
        assert_rejected("bus.name_prefix", "switch#board");
    }

    #[test]
    fn rejects_name_prefix_with_trailing_dot() {
        assert_rejected("bus.name_prefix", "switchboard.");
    }

    #[test]
    fn rejects_redis_sessions_without_url() {
        let problems = rejected("sessions.kind", "redis");
        assert_eq!(problems[0].key, "sessions.url");
    }

    #[test]
    fn rejects_sessions_url_with_wrong_scheme() {
        assert_rejected("sessions.url", "memcached://localhost:11211");
    }

    #[test]
    fn rejects_empty_key_prefix() {
        assert_rejected("sessions.key_prefix", "");
    }

    #[test]
    fn rejects_http_addr_that_does_not_parse() {
        assert_load_error("gateway.http_addr", "localhost");
    }

    #[test]
    fn rejects_zero_max_body_bytes() {
        assert_load_error("gateway.max_body_bytes", "0");
    }

    #[test]
    fn rejects_zero_request_timeout() {
        assert_rejected("gateway.request_timeout", "0s");
    }

    #[test]
    fn rejects_zero_outbox_poll_interval() {
        assert_rejected("gateway.outbox_poll_interval", "0ms");
    }

    #[test]
    fn rejects_zero_outbox_batch() {
        assert_load_error("gateway.outbox_batch", "0");
    }

    #[test]
    fn rejects_zero_default_run_timeout() {
        assert_rejected("orchestrator.default_run_timeout", "0s");
    }

    #[test]
    fn rejects_zero_lease_grace() {
        assert_rejected("orchestrator.lease_grace", "0s");
    }

    #[test]
    fn rejects_a_membership_ttl_not_above_the_heartbeat() {
        assert_rejected("orchestrator.membership_ttl", "2s");
        assert_rejected("orchestrator.membership_heartbeat", "0s");
    }

    #[test]
    fn rejects_zero_reaper_interval() {
        assert_rejected("orchestrator.reaper_interval", "0s");
    }

    #[test]
    fn scheduler_interval_defaults_to_a_second_and_must_be_positive() {
        let config = loader().load().unwrap();
        assert_eq!(
            config.orchestrator.scheduler_interval,
            Duration::from_secs(1)
        );
        let config = loader()
            .set("orchestrator.scheduler_interval", "250ms")
            .load()
            .unwrap();
        assert_eq!(
            config.orchestrator.scheduler_interval,
            Duration::from_millis(250)
        );
        assert_rejected("orchestrator.scheduler_interval", "0s");
        assert_load_error("orchestrator.scheduler_interval", "often");
    }

    #[test]
    fn retention_defaults_overrides_and_rejections() {
        let config = loader().load().unwrap();
        assert!(config.retention.enabled);
        assert_eq!(config.retention.run_results, Duration::from_secs(24 * 3600));
        assert_eq!(
            config.retention.closed_session_identities,
            Duration::from_secs(7 * 24 * 3600)
        );
        let config = loader()
            .env([("SWITCHBOARD__RETENTION__RUN_RESULTS", "2s")])
            .set("retention.event_log", "30d")
            .load()
            .unwrap();
        assert_eq!(config.retention.run_results, Duration::from_secs(2));
        assert_eq!(
            config.retention.event_log,
            Duration::from_secs(30 * 24 * 3600)
        );
        for key in [
            "retention.interval",
            "retention.run_results",
            "retention.event_log",
            "retention.transcript",
            "retention.outbox_published",
            "retention.closed_session_identities",
        ] {
            assert_rejected(key, "0s");
        }
        assert_load_error("retention.batch_size", "0");
        assert_load_error("retention.max_batches_per_pass", "0");
    }

    #[test]
    fn rejects_worker_id_with_spaces() {
        assert_rejected("worker.id", "my worker");
    }

    #[test]
    fn rejects_empty_pools() {
        assert_rejected("worker.pools", OverrideValue::List(vec![]));
    }

    #[test]
    fn rejects_pool_with_dot() {
        assert_rejected("worker.pools", "gpu.large");
    }

    #[test]
    fn rejects_zero_slots() {
        assert_load_error("worker.slots", "0");
    }

    #[test]
    fn rejects_empty_runners_dirs() {
        assert_rejected("worker.runners_dirs", "");
    }

    #[test]
    fn rejects_heartbeat_not_below_lease_ttl() {
        let err = loader()
            .set("worker.heartbeat_interval", "10s")
            .set("worker.lease_ttl", "10s")
            .load()
            .unwrap_err();
        assert_eq!(err.problems()[0].key, "worker.heartbeat_interval");
    }

    #[test]
    fn rejects_zero_heartbeat() {
        assert_rejected("worker.heartbeat_interval", "0s");
    }

    #[test]
    fn rejects_zero_lease_ttl() {
        assert_rejected("worker.lease_ttl", "0s");
    }

    #[test]
    fn rejects_result_cap_not_below_line_cap() {
        assert_rejected("worker.max_result_bytes", (4 * MIB).to_string());
    }

    #[test]
    fn rejects_zero_max_line_bytes() {
        assert_load_error("worker.max_line_bytes", "0");
    }

    #[test]
    fn rejects_zero_cancel_grace() {
        assert_rejected("worker.cancel_grace", "0s");
    }

    #[test]
    fn rejects_zero_drain_timeout() {
        assert_rejected("worker.drain_timeout", "0s");
    }

    #[test]
    fn rejects_negative_number() {
        assert_load_error("worker.stderr_cap_bytes", "-1");
    }

    #[test]
    fn rejects_zero_model_timeout() {
        assert_rejected("providers.model_timeout", "0s");
    }

    #[test]
    fn rejects_zero_stream_idle_timeout() {
        assert_rejected("providers.stream_idle_timeout", "0ms");
    }

    #[test]
    fn rejects_zero_max_attempts() {
        assert_load_error("providers.max_attempts", "0");
    }

    #[test]
    fn rejects_zero_retry_backoff() {
        assert_rejected("providers.retry_backoff", "0s");
    }

    #[test]
    fn rejects_zero_provider_connect_timeout() {
        assert_rejected("providers.connect_timeout", "0s");
    }

    #[test]
    fn rejects_zero_max_response_bytes() {
        assert_load_error("providers.max_response_bytes", "0");
    }

    #[test]
    fn rejects_unknown_providers_key() {
        let err = loader()
            .env(env(&[("SWITCHBOARD__PROVIDERS__TIMEOUT", "5s")]))
            .load()
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown field `timeout`"), "{msg}");
        assert!(msg.contains("`providers`"), "{msg}");
    }

    #[test]
    fn rejects_artifact_read_default_above_cap() {
        assert_rejected("limits.artifact_read_default_bytes", (11 * MIB).to_string());
    }

    #[test]
    fn rejects_page_size_default_above_max() {
        assert_rejected("limits.page_size_default", "101");
    }

    #[test]
    fn rejects_state_page_size_default_above_max() {
        assert_rejected("limits.state_page_size_default", "500");
    }

    #[test]
    fn tool_ceilings_are_configurable() {
        let c = loader()
            .set("limits.tool_timeout_max", "30s")
            .set("limits.tool_response_bytes_max", "65536")
            .load()
            .unwrap();
        assert_eq!(c.limits.tool_timeout_max, Duration::from_secs(30));
        assert_eq!(c.limits.tool_response_bytes_max.get(), 65536);
        let d = LimitsConfig::default();
        assert_eq!(d.tool_timeout_max, Duration::from_secs(120));
        assert_eq!(d.tool_response_bytes_max.get(), 16 * MIB);
    }

    #[test]
    fn rejects_a_zero_run_max_duration() {
        assert_rejected("limits.run_max_duration", "0s");
    }

    #[test]
    fn rejects_a_zero_deliver_at_max_delay() {
        assert_rejected("limits.deliver_at_max_delay", "0s");
    }

    #[test]
    fn rejects_tool_timeout_max_below_a_millisecond() {
        assert_rejected("limits.tool_timeout_max", "0s");
        assert_rejected("limits.tool_timeout_max", "999us");
    }

    #[test]
    fn rejects_zero_tool_response_bytes_max() {
        assert_load_error("limits.tool_response_bytes_max", "0");
    }

    #[test]
    fn rejects_zero_budget() {
        assert_load_error("limits.budgets.max_model_calls", "0");
    }

    #[test]
    fn rejects_bad_log_filter() {
        assert_rejected("telemetry.log_level", "info,=[");
    }

    #[test]
    fn rejects_non_boolean_json_flag() {
        assert_load_error("telemetry.json", "maybe");
    }

    #[test]
    fn the_dev_model_comes_from_file_environment_and_cli() {
        assert_eq!(loader().load().unwrap().dev.default_model(), None);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dev.toml");
        std::fs::write(
            &file,
            r#"
            [dev]
            model_url = "http://127.0.0.1:11434/v1"
            model = "llama3.2"
            model_context_window = 131072
            "#,
        )
        .unwrap();
        let c = loader().file(&file).load().unwrap();
        let model = c.dev.default_model().unwrap();
        assert_eq!(model.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(model.model, "llama3.2");
        assert_eq!(model.api_key_env, None);
        assert_eq!(model.context_window.map(NonZeroU32::get), Some(131_072));

        let vars = env(&[
            ("SWITCHBOARD__DEV__MODEL", "qwen2.5"),
            ("SWITCHBOARD__DEV__MODEL_KEY_ENV", "OPENAI_API_KEY"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        let model = c.dev.default_model().unwrap();
        assert_eq!(model.model, "qwen2.5", "environment over file");
        assert_eq!(model.api_key_env.as_deref(), Some("OPENAI_API_KEY"));
        let c = loader()
            .file(&file)
            .env(vars)
            .set("dev.model", "gpt-4o-mini")
            .load()
            .unwrap();
        assert_eq!(
            c.dev.default_model().unwrap().model,
            "gpt-4o-mini",
            "CLI over environment"
        );
    }

    #[test]
    fn rejects_a_dev_model_url_without_a_model_and_the_reverse() {
        let problems = rejected("dev.model_url", "http://127.0.0.1:11434/v1");
        assert!(
            problems.iter().any(|p| p.key == "dev.model"),
            "{problems:?}"
        );
        let problems = rejected("dev.model", "llama3.2");
        assert!(
            problems.iter().any(|p| p.key == "dev.model_url"),
            "{problems:?}"
        );
    }

    #[test]
    fn rejects_unusable_dev_model_urls() {
        for url in [
            "not a url",
            "ftp://models.example/v1",
            "http://user:secret@127.0.0.1:11434/v1",
            " ",
        ] {
            let problems = match loader()
                .set("dev.model_url", url)
                .set("dev.model", "m")
                .load()
            {
                Err(ConfigError::Invalid(problems)) => problems,
                other => panic!("{url}: expected a validation error, got {other:?}"),
            };
            assert!(
                problems.iter().any(|p| p.key == "dev.model_url"),
                "{url}: {problems:?}"
            );
            assert!(
                problems.iter().all(|p| !p.reason.contains("secret")),
                "credentials are not echoed: {problems:?}"
            );
        }
    }

    #[test]
    fn rejects_a_host_variable_as_the_dev_model_key() {
        assert_rejected("dev.model_key_env", "SWITCHBOARD__DATABASE__URL");
        assert_rejected("dev.model_key_env", "NOT-A-NAME");
    }

    #[test]
    fn rejects_a_zero_dev_context_window() {
        assert_load_error("dev.model_context_window", "0");
    }
}
