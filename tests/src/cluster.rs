//! Cluster mode end to end: every role runs as its own `switchboard` process on RabbitMQ,
//! Redis and Postgres (SPEC §1.1), exactly as an operator starts them, and the suites drive
//! the deployment through the gateways' HTTP API only.
//!
//! [`TestCluster::spawn`] builds one isolated deployment on the shared local services:
//!
//! | service | isolation |
//! | --- | --- |
//! | Postgres | a fresh schema `sbc_<id>`; every process gets a database URL whose libpq `options` set `search_path` (`?options=-c%20search_path%3Dsbc_<id>`), which sqlx applies to every pooled connection |
//! | RabbitMQ | every exchange and queue is named `test-<id>.switchboard.*` (`bus.name_prefix`) |
//! | Redis | every key starts with `sbtest:<id>:` (`sessions.key_prefix`) |
//!
//! then runs `switchboard migrate` and `switchboard keys create`, starts the orchestrators,
//! workers and gateways (gateways on port 0; the bound address is read from their log), waits
//! until each has logged its start and every gateway answers `/readyz`, and creates the echo
//! agent with `POST /v1/agents`. Every process is configured through `SWITCHBOARD__*`
//! variables (plus `--http-addr`, `--worker-id`, `--database-url` flags), which is the
//! interface a deployment uses.
//!
//! Dropping the cluster stops the processes (SIGTERM, then SIGKILL after
//! [`STOP_GRACE`]), then drops the schema, deletes the durable queues and exchanges (the
//! gateways' and workers' exclusive queues went with their connections) and the Redis keys.
//! The processes stay in the test's process group, so a test runner that kills the group
//! (nextest on a timeout) takes them along. Logs go to `<tempdir>/logs/<role>-<n>.log`; the
//! directory is kept, and its path printed, when the test panics (or always, with
//! `SB_TEST_KEEP_CLUSTER_LOGS=1`).
//!
//! The `switchboard` binary is taken from the target directory next to the test executable
//! (`scripts/test` builds the binaries first), or from `SWITCHBOARD_BIN`.
//!
//! # Layout
//! - [`Services`]: the service URLs (environment, local defaults) and the reachability check;
//! - [`ClusterSpec`], [`TestCluster`]: the deployment and its processes;
//! - [`child_processes`]: runner processes of a worker, for counting executions;
//! - failure injection: [`TestCluster::kill_process`], [`TestCluster::signal_process`]
//!   (SIGSTOP / SIGCONT) and [`TestCluster::restart_process`] (same role, number, worker id
//!   and gateway address), used by the chaos suite (`tests/chaos`), which also passes its own
//!   services to [`TestCluster::spawn_on`].
//!
//! The suites talk to the gateways with the crate's [`Client`] (and its
//! [`SseStream`](crate::SseStream)), the same client the embedded suites use.

use std::fs::File;
use std::io::{BufRead as _, BufReader, Write as _};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
use sb_common::bus::topology::{Topology, TopologyOptions};
use sb_common::bus::{Bus as _, QueueType};
use sb_common::config::{ConfigLoader, QueueType as ConfigQueueType, SwitchboardConfig};
use sb_common::session::redis::{RedisOptions, RedisSessionStore};
use sb_store::{SqlStore, SqlStoreOptions};
use serde_json::{Value, json};

use crate::{Client, ECHO, repo_dir, target_dir};

/// Time the processes get between SIGTERM and SIGKILL when the cluster is dropped. A
/// cluster's in-flight runs are the test's business; the drain only has to be orderly.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// Time every process gets to start (connect, declare the topology, register runners).
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Pooled database connections per role process: six processes of a cluster, two clusters
/// at once (nextest's default parallelism on two cores) and the other suites must stay below
/// Postgres' default `max_connections = 100`.
const DB_CONNECTIONS_PER_PROCESS: u32 = 4;

/// Set (to anything) to keep the logs of every cluster, not only of failed tests.
pub const KEEP_LOGS_VAR: &str = "SB_TEST_KEEP_CLUSTER_LOGS";
/// Log lines the harness waits for (written by `switchboard::embedded` / `cli::roles`).
const STARTED_MARKER: &str = "switchboard started";
const GATEWAY_READY_MARKER: &str = "gateway ready";
/// Logged by an orchestrator or worker serving `/metrics` (`telemetry.metrics_listen`).
const METRICS_READY_MARKER: &str = "metrics ready";

type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Harness result: failures carry a message (with the log tail of the process concerned).
pub type Result<T, E = BoxError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// Services
// ---------------------------------------------------------------------------------------------

/// The shared services a cluster runs on (DESIGN-NOTES "Tests against real services").
#[derive(Debug, Clone)]
pub struct Services {
    /// Postgres database URL (no schema: the cluster adds its own).
    pub database_url: String,
    /// Redis URL.
    pub redis_url: String,
    /// RabbitMQ URL.
    pub amqp_url: String,
}

impl Services {
    /// From `SWITCHBOARD_TEST_DATABASE_URL`, `SWITCHBOARD_TEST_REDIS_URL`,
    /// `SWITCHBOARD_TEST_AMQP_URL`, with the local defaults.
    #[must_use]
    pub fn from_env() -> Self {
        let var = |name: &str, default: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| default.to_owned())
        };
        Self {
            database_url: var(
                "SWITCHBOARD_TEST_DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            redis_url: var("SWITCHBOARD_TEST_REDIS_URL", "redis://127.0.0.1:6379"),
            amqp_url: var(
                "SWITCHBOARD_TEST_AMQP_URL",
                "amqp://guest:guest@127.0.0.1:5672/%2f",
            ),
        }
    }

    /// `None` when every service accepts TCP connections, else which one does not (and
    /// where). Only reachability is checked: a reachable service that misbehaves must fail
    /// the tests, not skip them.
    pub async fn unreachable(&self) -> Option<String> {
        for (name, url, default_port) in [
            ("postgres", &self.database_url, 5432),
            ("redis", &self.redis_url, 6379),
            ("rabbitmq", &self.amqp_url, 5672),
        ] {
            let Ok(parsed) = reqwest::Url::parse(url) else {
                return Some(format!("{name}: invalid URL in the environment"));
            };
            let host = parsed.host_str().unwrap_or("127.0.0.1").to_owned();
            let port = parsed.port().unwrap_or(default_port);
            let connect = tokio::net::TcpStream::connect((host.as_str(), port));
            match tokio::time::timeout(Duration::from_secs(3), connect).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Some(format!("{name} at {host}:{port}: {e}")),
                Err(_) => return Some(format!("{name} at {host}:{port}: connect timed out")),
            }
        }
        None
    }
}

// ---------------------------------------------------------------------------------------------
// The cluster
// ---------------------------------------------------------------------------------------------

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Gateway processes.
    pub gateways: usize,
    /// Orchestrator processes.
    pub orchestrators: usize,
    /// Worker processes.
    pub workers: usize,
    /// Extra environment variables for every process: `SWITCHBOARD__*` settings (e.g.
    /// shorter leases), or anything else the processes read, like the API key variable a
    /// registered model names or `RUST_LOG`. Only `SWITCHBOARD__*` names reach the
    /// configuration; a runner process gets one only when its manifest lists the name (the
    /// worker clears their environment).
    pub env: Vec<(String, String)>,
}

impl Default for ClusterSpec {
    /// Two of each: every role is replicated, so every hand-over crosses a process boundary.
    fn default() -> Self {
        Self {
            gateways: 2,
            orchestrators: 2,
            workers: 2,
            env: Vec::new(),
        }
    }
}

impl ClusterSpec {
    /// Adds an environment variable for every process (see the `env` field).
    #[must_use]
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }
}

/// A role of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `switchboard gateway`.
    Gateway,
    /// `switchboard orchestrator`.
    Orchestrator,
    /// `switchboard worker`.
    Worker,
}

impl Role {
    fn command(self) -> &'static str {
        match self {
            Self::Gateway => "gateway",
            Self::Orchestrator => "orchestrator",
            Self::Worker => "worker",
        }
    }
}

/// What the log of a process has shown so far.
#[derive(Debug, Default)]
struct LogState {
    started: bool,
    gateway_url: Option<String>,
    /// `http://127.0.0.1:<port>` of `/metrics` of a non-gateway process, once it serves them.
    metrics_url: Option<String>,
}

/// One role process.
struct RoleProcess {
    role: Role,
    /// Its number among the processes of its role.
    n: usize,
    /// `gateway-0`, `worker-1`, …
    name: String,
    child: Child,
    log: PathBuf,
    state: Arc<Mutex<LogState>>,
    /// `--worker-id` of a worker.
    worker_id: Option<String>,
    /// `http://127.0.0.1:<port>` of a gateway, once started.
    url: Option<String>,
}

impl RoleProcess {
    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX))
    }
}

/// A running multi-process deployment (see the module docs). Dropping it stops and removes
/// everything.
pub struct TestCluster {
    id: String,
    services: Services,
    schema: String,
    database_url: String,
    config: SwitchboardConfig,
    env: Vec<(String, String)>,
    bin: PathBuf,
    dir: Option<tempfile::TempDir>,
    processes: Vec<RoleProcess>,
    http: reqwest::Client,
    api_key: String,
    agent_id: String,
    store: Option<SqlStore>,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("id", &self.id)
            .field("schema", &self.schema)
            .field("processes", &self.processes.len())
            .finish_non_exhaustive()
    }
}

impl TestCluster {
    /// [`Self::spawn`] on [`Services::from_env`], or `None` (with a message on stderr) when
    /// a service is unreachable, so a suite can skip instead of failing on a machine without
    /// the services. Any other failure panics, and so does an unreachable service when
    /// `SWITCHBOARD_TEST_REQUIRE_SERVICES` is set (`scripts/test` sets it: there a skipped
    /// cluster test would be a test that cannot fail).
    pub async fn spawn_or_skip(spec: ClusterSpec) -> Option<Self> {
        let services = Services::from_env();
        if let Some(why) = services.unreachable().await {
            assert!(
                std::env::var_os("SWITCHBOARD_TEST_REQUIRE_SERVICES").is_none(),
                "cluster tests need Postgres, Redis and RabbitMQ: {why}"
            );
            eprintln!(
                "SKIPPED: cluster tests need Postgres, Redis and RabbitMQ: {why} (scripts/test starts them)"
            );
            return None;
        }
        match Self::spawn_on(services, spec).await {
            Ok(cluster) => Some(cluster),
            Err(error) => panic!("cannot start the test cluster: {error}"),
        }
    }

    /// Starts a cluster on [`Services::from_env`].
    pub async fn spawn(spec: ClusterSpec) -> Result<Self> {
        Self::spawn_on(Services::from_env(), spec).await
    }

    /// Starts a cluster on `services` (see the module docs for the steps).
    pub async fn spawn_on(services: Services, spec: ClusterSpec) -> Result<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let schema = format!("sbc_{id}");
        let database_url = with_search_path(&services.database_url, &schema);
        let dir = tempfile::Builder::new()
            .prefix(&format!("sb-cluster-{id}-"))
            .tempdir()?;
        std::fs::create_dir_all(dir.path().join("logs"))?;

        let mut env = vec![
            (
                "SWITCHBOARD__DATABASE__URL".to_owned(),
                database_url.clone(),
            ),
            (
                "SWITCHBOARD__DATABASE__MAX_CONNECTIONS".to_owned(),
                DB_CONNECTIONS_PER_PROCESS.to_string(),
            ),
            ("SWITCHBOARD__BUS__KIND".to_owned(), "amqp".to_owned()),
            (
                "SWITCHBOARD__BUS__URL".to_owned(),
                services.amqp_url.clone(),
            ),
            (
                "SWITCHBOARD__BUS__NAME_PREFIX".to_owned(),
                format!("test-{id}.switchboard"),
            ),
            ("SWITCHBOARD__SESSIONS__KIND".to_owned(), "redis".to_owned()),
            (
                "SWITCHBOARD__SESSIONS__URL".to_owned(),
                services.redis_url.clone(),
            ),
            (
                "SWITCHBOARD__SESSIONS__KEY_PREFIX".to_owned(),
                format!("sbtest:{id}:"),
            ),
            (
                "SWITCHBOARD__WORKER__RUNNERS_DIRS".to_owned(),
                [
                    repo_dir().join("runners"),
                    repo_dir().join("tests").join("runners"),
                ]
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(","),
            ),
        ];
        env.extend(spec.env.iter().cloned());
        // The same layers the processes load (minus their flags): validates the environment
        // before anything starts and tells the cleanup which topology to delete.
        let config = ConfigLoader::new()
            .without_file()
            .env(env.iter().cloned())
            .load()?;

        let mut cluster = Self {
            id,
            services,
            schema,
            database_url,
            config,
            env,
            bin: switchboard_bin()?,
            dir: Some(dir),
            processes: Vec::new(),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()?,
            api_key: String::new(),
            agent_id: String::new(),
            store: None,
        };
        // From here on, a failure drops `cluster`, which removes whatever was created.
        cluster.prepare_database().await?;
        cluster.start_processes(&spec).await?;
        let agent = cluster
            .create_agent(json!({"name": "echo", "runner_id": ECHO}))
            .await?;
        cluster.agent_id = agent["agent_id"]
            .as_str()
            .ok_or("agent response without agent_id")?
            .to_owned();
        Ok(cluster)
    }

    /// Schema, migrations (`switchboard migrate`), API key (`switchboard keys create`).
    async fn prepare_database(&mut self) -> Result<()> {
        let options = SqlStoreOptions {
            max_connections: 2,
            min_connections: 0,
            ..SqlStoreOptions::default()
        };
        // Creates the schema; the pool is kept for the suites' direct ledger checks.
        self.store = Some(
            SqlStore::connect_with_schema(&self.services.database_url, &self.schema, &options)
                .await?,
        );
        self.run_tool(
            "migrate",
            &["migrate", "--database-url", &self.database_url],
        )?;
        let key = self.run_tool(
            "keys",
            &[
                "keys",
                "create",
                "--workspace",
                "default",
                "--database-url",
                &self.database_url,
            ],
        )?;
        let key = key.trim().to_owned();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(
                format!("`switchboard keys create` printed {key:?}, expected one key").into(),
            );
        }
        self.api_key = key;
        Ok(())
    }

    /// Runs a short-lived `switchboard` command to completion; returns its stdout.
    fn run_tool(&self, name: &str, args: &[&str]) -> Result<String> {
        let log = self.logs_dir().join(format!("{name}.log"));
        let mut command = self.command(args);
        command.stdout(Stdio::piped()).stderr(File::create(&log)?);
        let output = command.output()?;
        if !output.status.success() {
            return Err(format!(
                "`switchboard {}` failed ({}):\n{}",
                args.join(" "),
                output.status,
                tail(&log, 40)
            )
            .into());
        }
        Ok(String::from_utf8(output.stdout)?)
    }

    /// A `switchboard` command with the cluster's environment, in the cluster directory (so
    /// no `./switchboard.toml` of the developer's checkout is picked up).
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.bin);
        command.args(args).current_dir(self.dir_path());
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("SWITCHBOARD__") {
                command.env_remove(key);
            }
        }
        // One runtime thread per process, as `scripts/cluster` gives each role: the
        // current-thread scheduler (`switchboard::cli::runtime`) is what the cluster runs on.
        command
            .env(switchboard::cli::runtime::WORKER_THREADS_ENV, "1")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null());
        command
    }

    async fn start_processes(&mut self, spec: &ClusterSpec) -> Result<()> {
        // Consumers first, the ingest last, like `switchboard::embedded` inside one process;
        // waiting is done for all of them at once.
        for i in 0..spec.orchestrators {
            self.start_process(Role::Orchestrator, i)?;
        }
        for i in 0..spec.workers {
            self.start_process(Role::Worker, i)?;
        }
        for i in 0..spec.gateways {
            self.start_process(Role::Gateway, i)?;
        }
        let indices: Vec<usize> = (0..self.processes.len()).collect();
        for index in indices {
            self.wait_started(index, START_TIMEOUT).await?;
        }
        for url in self.gateway_urls() {
            self.wait_ready(&url).await?;
        }
        Ok(())
    }

    /// Starts one more role process (not waited for; see [`Self::wait_started`]). Returns its
    /// index.
    fn start_process(&mut self, role: Role, n: usize) -> Result<usize> {
        let process = self.spawn_role(role, n, None)?;
        self.processes.push(process);
        Ok(self.processes.len() - 1)
    }

    /// Spawns the `n`th process of `role`, a gateway on `http_addr` (default: port 0). Its
    /// log is appended to, so a restarted process continues the log of its predecessor.
    fn spawn_role(&self, role: Role, n: usize, http_addr: Option<&str>) -> Result<RoleProcess> {
        let name = format!("{}-{n}", role.command());
        let log_path = self.logs_dir().join(format!("{name}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut args = vec![role.command().to_owned()];
        let mut worker_id = None;
        match role {
            Role::Gateway => args.extend([
                "--http-addr".to_owned(),
                http_addr.unwrap_or("127.0.0.1:0").to_owned(),
            ]),
            Role::Worker => {
                let id = self.worker_id(n);
                args.extend(["--worker-id".to_owned(), id.clone()]);
                worker_id = Some(id);
            }
            Role::Orchestrator => {}
        }
        let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut command = self.command(&arg_refs);
        command.stdout(log.try_clone()?).stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        let state = Arc::new(Mutex::new(LogState::default()));
        let tee_state = Arc::clone(&state);
        std::thread::Builder::new()
            .name(format!("log-{name}"))
            .spawn(move || tee_log(stderr, log, &tee_state))?;
        Ok(RoleProcess {
            role,
            n,
            name,
            child,
            log: log_path,
            state,
            worker_id,
            url: None,
        })
    }

    /// Waits until process `index` has logged its start (and, for a gateway, its address).
    async fn wait_started(&mut self, index: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let process = &mut self.processes[index];
            {
                let state = process.state.lock().map_err(|_| "log state poisoned")?;
                let ready =
                    state.started && (process.role != Role::Gateway || state.gateway_url.is_some());
                if ready {
                    process.url.clone_from(&state.gateway_url);
                    return Ok(());
                }
            }
            if let Some(status) = process.child.try_wait()? {
                // Give the log thread a moment to write the last lines.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Err(format!(
                    "{} exited during start ({status}):\n{}",
                    process.name,
                    tail(&process.log, 40)
                )
                .into());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} did not start within {timeout:?}:\n{}",
                    process.name,
                    tail(&process.log, 40)
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_ready(&self, url: &str) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let answer = self.http.get(format!("{url}/readyz")).send().await;
            match answer {
                Ok(r) if r.status().is_success() => return Ok(()),
                _ if Instant::now() >= deadline => {
                    return Err(format!("{url}/readyz is not ready after {START_TIMEOUT:?}").into());
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Creates an agent in workspace `default` (`POST /v1/agents` on gateway 0), retrying
    /// while its runner is not registered yet (`422`). Returns the agent.
    pub async fn create_agent(&self, body: Value) -> Result<Value> {
        let client = self.client(0);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let response = client.create_agent(&body).await;
            match response.status {
                201 => return Ok(response.body),
                422 if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                status => {
                    return Err(format!("POST /v1/agents: {status} {}", response.body).into());
                }
            }
        }
    }

    // --- accessors -------------------------------------------------------------------------

    /// Unique id of this cluster (part of every name it uses).
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The Postgres schema.
    #[must_use]
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The database URL every process uses (search path included).
    #[must_use]
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// The configuration every process loads (without its flags).
    #[must_use]
    pub fn config(&self) -> &SwitchboardConfig {
        &self.config
    }

    /// The bus topology of the cluster (names with its prefix).
    pub fn topology(&self) -> Result<Topology> {
        Ok(Topology::new(topology_options(&self.config))?)
    }

    /// The services.
    #[must_use]
    pub fn services(&self) -> &Services {
        &self.services
    }

    /// A store on the cluster's schema, for checks the API does not expose.
    #[must_use]
    pub fn store(&self) -> &SqlStore {
        self.store
            .as_ref()
            .expect("the store lives as long as the cluster")
    }

    /// The API key of workspace `default`.
    #[must_use]
    pub fn api_key(&self) -> &str {
        &self.api_key
    }

    /// The echo agent created at start.
    #[must_use]
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// `--worker-id` of worker `n`.
    #[must_use]
    pub fn worker_id(&self, n: usize) -> String {
        format!("c{}-worker-{n}", self.id)
    }

    /// Worker ids of the running workers.
    #[must_use]
    pub fn worker_ids(&self) -> Vec<String> {
        self.processes
            .iter()
            .filter_map(|p| p.worker_id.clone())
            .collect()
    }

    /// Base URLs of the gateways, in start order.
    #[must_use]
    pub fn gateway_urls(&self) -> Vec<String> {
        self.processes
            .iter()
            .filter(|p| p.role == Role::Gateway)
            .filter_map(|p| {
                p.url
                    .clone()
                    .or_else(|| p.state.lock().ok().and_then(|s| s.gateway_url.clone()))
            })
            .collect()
    }

    /// A client of gateway `n` (modulo the number of gateways) for workspace `default`.
    #[must_use]
    pub fn client(&self, n: usize) -> Client {
        let urls = self.gateway_urls();
        Client::new(&urls[n % urls.len()], &self.api_key)
    }

    /// The log of the process `name` (`worker-0`, …), for failure messages.
    #[must_use]
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        self.processes
            .iter()
            .find(|p| p.name == name)
            .map_or_else(|| format!("no process {name}"), |p| tail(&p.log, lines))
    }

    /// Where the logs are.
    #[must_use]
    pub fn logs_dir(&self) -> PathBuf {
        self.dir_path().join("logs")
    }

    fn dir_path(&self) -> &Path {
        self.dir
            .as_ref()
            .map_or(Path::new("."), tempfile::TempDir::path)
    }

    // --- failure injection -----------------------------------------------------------------

    /// Kills the worker with `worker_id` with SIGKILL (a crash: no drain, no lease release,
    /// its runner processes lose their host) and waits for it to be gone.
    pub fn kill_worker(&mut self, worker_id: &str) -> Result<()> {
        let process = self
            .processes
            .iter_mut()
            .find(|p| p.worker_id.as_deref() == Some(worker_id))
            .ok_or_else(|| format!("no worker {worker_id}"))?;
        process.child.kill()?;
        process.child.wait()?;
        Ok(())
    }

    /// Names of every process (`gateway-0`, `orchestrator-1`, `worker-0`, …), in start order.
    #[must_use]
    pub fn process_names(&self) -> Vec<String> {
        self.processes.iter().map(|p| p.name.clone()).collect()
    }

    /// Names of the processes of `role`.
    #[must_use]
    pub fn process_names_of(&self, role: Role) -> Vec<String> {
        self.processes
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.name.clone())
            .collect()
    }

    /// Where process `name` serves `/metrics`: a gateway's API URL, or an orchestrator's or
    /// worker's `telemetry.metrics_listen` once it logged it (set
    /// `SWITCHBOARD__TELEMETRY__METRICS_LISTEN=127.0.0.1:0` in the spec for a free port each).
    #[must_use]
    pub fn metrics_url_of(&self, name: &str) -> Option<String> {
        let process = self.processes.iter().find(|p| p.name == name)?;
        if process.role == Role::Gateway {
            return process.url.clone();
        }
        process.state.lock().ok()?.metrics_url.clone()
    }

    /// Process id of the process `name`.
    #[must_use]
    pub fn pid_of(&self, name: &str) -> Option<u32> {
        self.processes
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.child.id())
    }

    /// Kills the process `name` with SIGKILL (a crash) and waits for it to be gone.
    pub fn kill_process(&mut self, name: &str) -> Result<()> {
        let process = self
            .processes
            .iter_mut()
            .find(|p| p.name == name)
            .ok_or_else(|| format!("no process {name}"))?;
        process.child.kill()?;
        process.child.wait()?;
        Ok(())
    }

    /// Sends `signal` to the process `name` (e.g. SIGSTOP / SIGCONT to freeze and resume it).
    pub fn signal_process(&self, name: &str, signal: Signal) -> Result<()> {
        let process = self
            .processes
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| format!("no process {name}"))?;
        kill(process.pid(), signal)?;
        Ok(())
    }

    /// Starts the process `name` again after it exited (see [`Self::kill_process`]), with the
    /// same role, number, worker id and, for a gateway, the same address; waits until it has
    /// started (and a gateway answers `/readyz`).
    pub async fn restart_process(&mut self, name: &str) -> Result<()> {
        let index = self
            .processes
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| format!("no process {name}"))?;
        if matches!(self.processes[index].child.try_wait(), Ok(None)) {
            return Err(format!("{name} is still running").into());
        }
        let old = &self.processes[index];
        let addr = old
            .url
            .as_deref()
            .map(|url| url.trim_start_matches("http://").to_owned());
        let process = self.spawn_role(old.role, old.n, addr.as_deref())?;
        self.processes[index] = process;
        self.wait_started(index, START_TIMEOUT).await?;
        if let Some(url) = self.processes[index].url.clone() {
            self.wait_ready(&url).await?;
        }
        Ok(())
    }

    /// Process ids of the running workers, by worker id.
    #[must_use]
    pub fn worker_pids(&self) -> Vec<(String, u32)> {
        self.processes
            .iter()
            .filter_map(|p| p.worker_id.clone().map(|id| (id, p.child.id())))
            .collect()
    }

    /// Lines of the logs of every `role` process that contain all of `needles`.
    #[must_use]
    pub fn log_lines(&self, role: Role, needles: &[&str]) -> Vec<String> {
        self.processes
            .iter()
            .filter(|p| p.role == role)
            .flat_map(|p| {
                std::fs::read_to_string(&p.log)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| needles.iter().all(|n| l.contains(n)))
                    .map(|l| format!("{}: {l}", p.name))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Whether the process `name` is still running.
    pub fn is_running(&mut self, name: &str) -> bool {
        self.processes
            .iter_mut()
            .find(|p| p.name == name)
            .is_some_and(|p| matches!(p.child.try_wait(), Ok(None)))
    }

    // --- stop ------------------------------------------------------------------------------

    /// Stops every process: SIGTERM, then SIGKILL for those still running after `grace`.
    fn stop_processes(&mut self, grace: Duration) {
        for p in &mut self.processes {
            if matches!(p.child.try_wait(), Ok(None)) {
                let _ = kill(p.pid(), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        loop {
            let mut running = 0;
            for p in &mut self.processes {
                if matches!(p.child.try_wait(), Ok(None)) {
                    running += 1;
                }
            }
            if running == 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for p in &mut self.processes {
            if matches!(p.child.try_wait(), Ok(None)) {
                eprintln!("{} did not stop within {grace:?}; killing it", p.name);
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.stop_processes(STOP_GRACE);
        let store = self.store.take();
        let services = self.services.clone();
        let schema = self.schema.clone();
        let topology = topology_options(&self.config);
        let key_prefix = self.config.sessions.key_prefix.clone();
        // Drop may run inside the test's runtime, which cannot be blocked on: the async
        // cleanup gets a runtime of its own on a plain thread.
        let cleanup = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return vec![format!("cleanup runtime: {e}")],
            };
            runtime.block_on(async move {
                let mut problems = Vec::new();
                if let Some(store) = store {
                    let _ = store.close().await;
                }
                if let Err(e) = SqlStore::drop_schema(&services.database_url, &schema).await {
                    problems.push(format!("drop schema {schema}: {e}"));
                }
                if let Err(e) = delete_topology(&services.amqp_url, topology).await {
                    problems.push(format!("delete the bus topology: {e}"));
                }
                let redis = RedisOptions::new(services.redis_url.clone(), key_prefix.clone());
                match RedisSessionStore::connect(&redis).await {
                    Ok(store) => {
                        if let Err(e) = store.delete_all().await {
                            problems.push(format!("delete redis keys {key_prefix}*: {e}"));
                        }
                    }
                    Err(e) => problems.push(format!("connect to redis: {e}")),
                }
                problems
            })
        });
        match cleanup.join() {
            Ok(problems) => {
                for problem in problems {
                    eprintln!("cluster {} cleanup: {problem}", self.id);
                }
            }
            Err(_) => eprintln!("cluster {} cleanup panicked", self.id),
        }
        if std::thread::panicking() || std::env::var_os(KEEP_LOGS_VAR).is_some() {
            if let Some(dir) = self.dir.take() {
                let kept = dir.keep();
                eprintln!(
                    "cluster {} logs kept in {}",
                    self.id,
                    kept.join("logs").display()
                );
            }
        }
    }
}

async fn delete_topology(amqp_url: &str, options: TopologyOptions) -> Result<()> {
    let bus = AmqpBus::connect(AmqpOptions::new(amqp_url, "sb-tests cluster cleanup")).await?;
    let topology = Topology::new(options)?;
    let result = topology.delete(&bus).await;
    let _ = bus.close().await;
    Ok(result?)
}

/// The topology the processes declare for `config` (mirrors `switchboard::embedded`).
fn topology_options(config: &SwitchboardConfig) -> TopologyOptions {
    let widen = |n: std::num::NonZeroU16| NonZeroU32::from(n);
    TopologyOptions {
        name_prefix: config.bus.name_prefix.clone(),
        events_shards: widen(config.bus.events_shards),
        results_shards: widen(config.bus.results_shards),
        pools: config.worker.pools.clone(),
        queue_type: match config.bus.queue_type {
            ConfigQueueType::Quorum => QueueType::Quorum,
            ConfigQueueType::Classic => QueueType::Classic,
        },
        delivery_limit: Some(config.bus.delivery_limit.get()),
    }
}

/// `url` with libpq `options` selecting `schema` for every connection (sqlx honours them at
/// connect, so every pooled connection of every process uses the schema).
#[must_use]
pub fn with_search_path(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20search_path%3D{schema}")
}

/// The `switchboard` binary: `SWITCHBOARD_BIN`, or `target/<profile>/switchboard` next to
/// the test executable's directory.
pub fn switchboard_bin() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SWITCHBOARD_BIN") {
        return Ok(PathBuf::from(path));
    }
    let path = target_dir().join(format!("switchboard{}", std::env::consts::EXE_SUFFIX));
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the switchboard binary {} is missing: run `cargo build --workspace --bins` first (scripts/test does)",
            path.display()
        )
        .into())
    }
}

/// Copies a process's stderr into its log file (without terminal colours) and records the
/// start markers.
fn tee_log(stderr: std::process::ChildStderr, mut log: File, state: &Mutex<LogState>) {
    let reader = BufReader::new(stderr);
    for line in reader.split(b'\n') {
        let Ok(line) = line else { break };
        let line = strip_ansi(&String::from_utf8_lossy(&line));
        let _ = writeln!(log, "{line}");
        if line.contains(STARTED_MARKER)
            || line.contains(GATEWAY_READY_MARKER)
            || line.contains(METRICS_READY_MARKER)
        {
            if let Ok(mut state) = state.lock() {
                if line.contains(STARTED_MARKER) {
                    state.started = true;
                }
                if line.contains(GATEWAY_READY_MARKER) {
                    state.gateway_url = http_url_in(&line);
                }
                if line.contains(METRICS_READY_MARKER) {
                    state.metrics_url = http_url_in(&line);
                }
            }
        }
    }
}

/// Live child processes of `parent` whose command name (`/proc/<pid>/stat`, at most 15
/// bytes) is `comm` (Linux).
#[must_use]
pub fn child_processes(parent: u32, comm: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // `pid (comm) state ppid …`; comm may contain spaces and parentheses.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                return false;
            };
            let name = &stat[open + 1..close];
            let mut rest = stat[close + 1..].split_whitespace();
            let state = rest.next().unwrap_or("Z");
            let ppid = rest.next().and_then(|p| p.parse::<u32>().ok());
            name == comm && ppid == Some(parent) && state != "Z"
        })
        .collect()
}

/// The first `http://…` in a log line (text or JSON format).
fn http_url_in(line: &str) -> Option<String> {
    let start = line.find("http://")?;
    let url: String = line[start..]
        .chars()
        .take_while(|c| !c.is_whitespace() && !matches!(c, '"' | ',' | '}'))
        .collect();
    Some(url)
}

/// Removes ANSI escape sequences (`ESC [ … letter`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// The last `lines` lines of a log file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    format!("--- {} ---\n{}", path.display(), all[from..].join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_path_is_added_to_the_url() {
        assert_eq!(
            with_search_path("postgres://h/db", "s1"),
            "postgres://h/db?options=-c%20search_path%3Ds1"
        );
        assert_eq!(
            with_search_path("postgres://h/db?sslmode=disable", "s1"),
            "postgres://h/db?sslmode=disable&options=-c%20search_path%3Ds1"
        );
    }

    #[test]
    fn gateway_url_is_found_in_text_and_json_logs() {
        let text = "2026-01-01T00:00:00Z  INFO switchboard::cli::roles: gateway ready url=http://127.0.0.1:4242";
        assert_eq!(http_url_in(text).as_deref(), Some("http://127.0.0.1:4242"));
        let json = r#"{"fields":{"message":"gateway ready","url":"http://127.0.0.1:4242"}}"#;
        assert_eq!(http_url_in(json).as_deref(), Some("http://127.0.0.1:4242"));
        assert_eq!(strip_ansi("\u{1b}[32m INFO\u{1b}[0m x"), " INFO x");
    }

    #[test]
    fn children_are_found_by_parent_and_name() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let found = child_processes(std::process::id(), "sleep");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, vec![child.id()]);
        assert!(child_processes(std::process::id(), "sleep").is_empty());
    }
}
