//! Test harness: one worker on the memory bus, the memory session store and an in-memory
//! SQLite ledger, hosting REAL runner processes (`echo` from `sb-runner-echo`, the scriptable
//! test runners of `sb-tests`). Build them first:
//!
//! ```text
//! cargo build -p sb-runner-echo -p sb-tests --bins
//! ```

#![allow(dead_code)]

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::{Topology, TopologyOptions};
use sb_common::bus::{
    BatchPublishError, Binding, Bus, BusError, ConsumeOptions, ExchangeSpec, Outgoing,
    PublishOptions, QueueSpec, QueueType, Subscription,
};
use sb_common::config::SwitchboardConfig;
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_common::shutdown::Shutdown;
// The run sessions the gate reads, built as the Host API's own tests build them.
use sb_host_api::testing::snapshot_in;
use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::manifest::RunnerId;
use sb_protocol::messages::{ControlMessage, ResultMessage, RunJob, decode_results, encode};
use sb_store::{NewRun, SqlStore, SqlStoreOptions, Stores};
use sb_worker::outlet::ResultOutlet;
use sb_worker::plugins::CommandLookup;
use sb_worker::{Worker, WorkerDeps, WorkerHandle, WorkerOptions};
use serde_json::json;

pub const ECHO: &str = "plugin:switchboard/echo/default";
/// `sb-test-runner` (scripted by the first word of the input, see its docs), shared mode.
pub const SCRIPTED: &str = "plugin:tests/scripted/default";
pub const WAIT: Duration = Duration::from_secs(20);

/// `target/<profile>` of this test binary (`target/<profile>/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// A runner binary built by cargo; panics with the build command if it is missing.
pub fn binary(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build -p sb-runner-echo -p sb-tests --bins` first",
        path.display()
    );
    path
}

/// A temporary plugins directory runners can enter: when the tests run as root the runners
/// run as `nobody` (SPEC §14), and a fresh temporary directory is mode 0700.
pub fn plugins_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Writes a plugin directory with one runner.
pub fn write_plugin(
    root: &Path,
    author: &str,
    name: &str,
    runner: &str,
    program: &Path,
    args: &[&str],
    mode: &str,
) {
    let dir = root.join(format!("{author}-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    let manifest = format!(
        r#"[plugin]
author = "{author}"
name = "{name}"
version = "0.1.0"

[[runners]]
name = "{runner}"
label = {{ en_US = "{runner}" }}
capabilities = {{ streaming = true }}

[runners.execution]
command = {program:?}
args = [{args}]
mode = "{mode}"
max_concurrency = 8
pool = "default"
"#,
        program = program.display().to_string(),
        args = args.join(", "),
    );
    std::fs::write(dir.join("manifest.toml"), manifest).unwrap();
}

/// The memory bus, with a switch that makes every publish to the results exchange fail
/// (`unavailable`), as during a broker outage.
pub struct FlakyBus {
    inner: Arc<MemoryBus>,
    results_exchange: String,
    pub fail_results: AtomicBool,
}

impl FlakyBus {
    fn failing(&self, exchange: &str) -> bool {
        exchange == self.results_exchange && self.fail_results.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Bus for FlakyBus {
    async fn declare_exchange(&self, spec: &ExchangeSpec) -> sb_common::bus::Result<()> {
        self.inner.declare_exchange(spec).await
    }
    async fn delete_exchange(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.delete_exchange(name).await
    }
    async fn declare_queue(&self, spec: &QueueSpec) -> sb_common::bus::Result<()> {
        self.inner.declare_queue(spec).await
    }
    async fn delete_queue(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.delete_queue(name).await
    }
    async fn inspect_queue(
        &self,
        name: &str,
    ) -> sb_common::bus::Result<Option<sb_common::bus::QueueUse>> {
        self.inner.inspect_queue(name).await
    }
    async fn retire_queue(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.retire_queue(name).await
    }
    async fn bind(&self, queue: &str, binding: &Binding) -> sb_common::bus::Result<()> {
        self.inner.bind(queue, binding).await
    }
    async fn unbind(&self, queue: &str, binding: &Binding) -> sb_common::bus::Result<()> {
        self.inner.unbind(queue, binding).await
    }
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: Bytes,
        options: PublishOptions,
    ) -> sb_common::bus::Result<()> {
        if self.failing(exchange) {
            return Err(BusError::Unavailable("broker outage (test)".into()));
        }
        self.inner
            .publish(exchange, routing_key, body, options)
            .await
    }
    async fn publish_batch(&self, messages: Vec<Outgoing>) -> Result<(), BatchPublishError> {
        if messages.iter().any(|m| self.failing(&m.exchange)) {
            return Err(BatchPublishError::all(messages.len(), || {
                BusError::Unavailable("broker outage (test)".into())
            }));
        }
        self.inner.publish_batch(messages).await
    }
    async fn subscribe(
        &self,
        queue: &QueueSpec,
        options: ConsumeOptions,
    ) -> sb_common::bus::Result<Subscription> {
        self.inner.subscribe(queue, options).await
    }
    async fn ping(&self) -> sb_common::bus::Result<()> {
        self.inner.ping().await
    }
    async fn close(&self) -> sb_common::bus::Result<()> {
        self.inner.close().await
    }
}

pub struct Harness {
    pub bus: Arc<MemoryBus>,
    pub flaky: Arc<FlakyBus>,
    pub deps: WorkerDeps,
    pub sessions: Arc<MemorySessionStore>,
    pub stores: Stores,
    pub topology: Topology,
    pub config: Arc<SwitchboardConfig>,
    pub shutdown: Shutdown,
    pub worker: Option<WorkerHandle>,
    pub results: Subscription,
    /// Results of a batch message not yet handed out by [`Harness::next_result`].
    pub buffered: std::collections::VecDeque<ResultMessage>,
    pub plugins: tempfile::TempDir,
}

/// Config tuned for tests: short heartbeat, lease, grace and drain.
pub fn test_config(plugins: &Path) -> SwitchboardConfig {
    let mut config = SwitchboardConfig::default();
    config.worker.id = Some(format!("worker-test-{}", uuid::Uuid::new_v4().simple()));
    config.worker.pools = vec!["default".into()];
    config.worker.slots = NonZeroU32::new(4).unwrap();
    config.worker.runners_dirs = vec![plugins.to_path_buf()];
    config.worker.heartbeat_interval = Duration::from_millis(100);
    config.worker.lease_ttl = Duration::from_millis(500);
    config.worker.cancel_grace = Duration::from_millis(500);
    config.worker.drain_timeout = Duration::from_secs(5);
    config
}

impl Harness {
    /// A harness with the echo runner; `tweak` adjusts the plugins dir and config first.
    pub async fn start(tweak: impl FnOnce(&Path, &mut SwitchboardConfig)) -> Self {
        let plugins = plugins_dir();
        write_plugin(
            plugins.path(),
            "switchboard",
            "echo",
            "default",
            &binary("echo"),
            &[],
            "shared",
        );
        write_plugin(
            plugins.path(),
            "tests",
            "scripted",
            "default",
            &binary("sb-test-runner"),
            &[],
            "shared",
        );
        let mut config = test_config(plugins.path());
        tweak(plugins.path(), &mut config);
        let config = Arc::new(config);
        let bus = Arc::new(MemoryBus::new());
        let sessions = Arc::new(MemorySessionStore::new());
        let sql = SqlStore::connect(
            "sqlite::memory:",
            &SqlStoreOptions {
                migrate: true,
                ..SqlStoreOptions::default()
            },
        )
        .await
        .expect("in-memory sqlite");
        let stores = Stores::from_sql(sql);
        let topology = Topology::new(TopologyOptions {
            name_prefix: format!("test-{}.switchboard", uuid::Uuid::new_v4().simple()),
            events_shards: NonZeroU32::new(1).unwrap(),
            results_shards: NonZeroU32::new(1).unwrap(),
            pools: vec!["default".into()],
            queue_type: QueueType::Quorum,
            delivery_limit: Some(10),
        })
        .unwrap();
        let flaky = Arc::new(FlakyBus {
            inner: bus.clone(),
            results_exchange: topology.results_exchange(),
            fail_results: AtomicBool::new(false),
        });
        let deps = WorkerDeps {
            bus: flaky.clone(),
            sessions: sessions.clone(),
            stores: stores.clone(),
            config: config.clone(),
            topology: topology.clone(),
        };
        let shutdown = Shutdown::new();
        let worker = spawn_worker(&deps, &shutdown).await;
        let results = bus
            .subscribe(&topology.results_queue(0), ConsumeOptions::prefetch(1000))
            .await
            .unwrap();
        Self {
            bus,
            flaky,
            deps,
            sessions,
            stores,
            topology,
            config,
            shutdown,
            worker: Some(worker),
            results,
            buffered: std::collections::VecDeque::new(),
            plugins,
        }
    }

    /// Another worker on the same bus, stores and session store (a fresh id).
    pub async fn another_worker(&self) -> (WorkerHandle, Shutdown) {
        self.another_worker_with(None).await
    }

    /// Another worker (a fresh id) that hands its runs' items to `outlet`, when given.
    pub async fn another_worker_with(
        &self,
        outlet: Option<Arc<dyn ResultOutlet>>,
    ) -> (WorkerHandle, Shutdown) {
        let mut config = (*self.config).clone();
        config.worker.id = Some(format!("worker-test-{}", uuid::Uuid::new_v4().simple()));
        let deps = WorkerDeps {
            config: Arc::new(config),
            ..self.deps.clone()
        };
        let shutdown = Shutdown::new();
        (spawn_worker_with(&deps, outlet, &shutdown).await, shutdown)
    }

    pub fn worker(&self) -> &WorkerHandle {
        self.worker.as_ref().expect("worker running")
    }

    /// Creates the run (status queued) and its session, as the orchestrator would, and
    /// returns the job to publish.
    pub async fn prepare_run(&self, runner: &str, text: &str) -> RunJob {
        self.prepare_run_with(runner, text, None).await
    }

    pub async fn prepare_run_with(
        &self,
        runner: &str,
        text: &str,
        deadline_at: Option<f64>,
    ) -> RunJob {
        self.prepare_run_in(&WorkspaceId::default_workspace(), runner, text, deadline_at)
            .await
    }

    /// Like [`Harness::prepare_run_with`], for a run of `workspace`.
    pub async fn prepare_run_in(
        &self,
        workspace: &WorkspaceId,
        runner: &str,
        text: &str,
        deadline_at: Option<f64>,
    ) -> RunJob {
        let run_id = RunId::new();
        let runner_id: RunnerId = runner.parse().unwrap();
        self.stores
            .runs
            .create_run(NewRun {
                id: Some(run_id),
                workspace_id: workspace.clone(),
                event_id: EventId::new(),
                agent_id: None,
                runner_id: runner.to_owned(),
                pool: "default".into(),
                conversation_id: Some("conv-1".into()),
                thread_id: None,
                bot_id: None,
                deadline_at: None,
                attempt: 1,
            })
            .await
            .unwrap();
        self.sessions
            .put_session(
                &run_id,
                &snapshot_in(workspace, run_id, &runner_id, deadline_at),
                Duration::from_secs(600),
            )
            .await
            .unwrap();
        RunJob::new(
            workspace.clone(),
            runner_id,
            "default",
            context(run_id, text, deadline_at),
        )
    }

    pub async fn publish_job(&self, job: &RunJob) {
        self.bus
            .publish(
                &self.topology.runs_exchange(),
                "default",
                encode(job).into(),
                PublishOptions::default(),
            )
            .await
            .unwrap();
    }

    pub async fn publish_cancel(&self, run_id: RunId, reason: &str) {
        let msg = ControlMessage::Cancel {
            run_id,
            reason: reason.into(),
        };
        self.bus
            .publish(
                &self.topology.control_exchange(),
                &sb_common::bus::topology::control_routing_key(&run_id),
                encode(&msg).into(),
                PublishOptions::best_effort(),
            )
            .await
            .unwrap();
    }

    /// The next result (its message acked), or a panic after [`WAIT`]. A batch message
    /// (`switchboard.results/1`) is handed out one item at a time.
    pub async fn next_result(&mut self) -> ResultMessage {
        if let Some(msg) = self.buffered.pop_front() {
            return msg;
        }
        let delivery = tokio::time::timeout(WAIT, self.results.next())
            .await
            .expect("a result within the wait")
            .expect("results subscription");
        self.buffered
            .extend(decode_results(&delivery.body).expect("a switchboard.result(s)/1 body"));
        delivery.ack().await.unwrap();
        self.buffered.pop_front().expect("a batch holds items")
    }

    /// Results up to and including the terminal one.
    pub async fn results_until_terminal(&mut self) -> Vec<ResultMessage> {
        let mut out = Vec::new();
        loop {
            let msg = self.next_result().await;
            let terminal = msg.result.is_terminal();
            out.push(msg);
            if terminal {
                return out;
            }
        }
    }

    /// `None` if no result arrives within `wait`.
    pub async fn no_result_within(&mut self, wait: Duration) -> Option<ResultMessage> {
        if let Some(msg) = self.buffered.pop_front() {
            return Some(msg);
        }
        match tokio::time::timeout(wait, self.results.next()).await {
            Err(_) => None,
            Ok(delivery) => {
                let delivery = delivery.unwrap();
                self.buffered
                    .extend(decode_results(&delivery.body).unwrap());
                delivery.ack().await.unwrap();
                self.buffered.pop_front()
            }
        }
    }

    pub fn runs_queue(&self) -> String {
        self.topology.runs_queue("default").name
    }

    /// Ready + unacked jobs in the runs queue.
    pub fn jobs_in_queue(&self) -> (usize, usize) {
        let q = self.runs_queue();
        (
            self.bus.ready_count(&q).unwrap_or(0),
            self.bus.unacked_count(&q).unwrap_or(0),
        )
    }

    /// Waits until `check` holds (polling), or panics after [`WAIT`].
    pub async fn eventually<F: FnMut() -> bool>(&self, what: &str, mut check: F) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !check() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the job queue is empty (every delivery settled).
    pub async fn jobs_settled(&self) {
        let q = self.runs_queue();
        let bus = self.bus.clone();
        self.eventually("the runs queue to be empty", move || {
            bus.ready_count(&q).unwrap_or(0) == 0 && bus.unacked_count(&q).unwrap_or(0) == 0
        })
        .await;
    }

    /// Triggers shutdown and waits for the worker's drain.
    pub async fn stop(&mut self) -> sb_worker::WorkerReport {
        self.shutdown.trigger();
        let worker = self.worker.take().expect("worker running");
        tokio::time::timeout(Duration::from_secs(60), worker.join())
            .await
            .expect("worker drains")
    }
}

async fn spawn_worker(deps: &WorkerDeps, shutdown: &Shutdown) -> WorkerHandle {
    spawn_worker_with(deps, None, shutdown).await
}

async fn spawn_worker_with(
    deps: &WorkerDeps,
    outlet: Option<Arc<dyn ResultOutlet>>,
    shutdown: &Shutdown,
) -> WorkerHandle {
    let options = WorkerOptions {
        bundled_runners: false,
        command_lookup: CommandLookup::default(),
        outlet,
        ..WorkerOptions::default()
    };
    Worker::spawn_with(deps.clone(), options, shutdown.clone())
        .await
        .expect("worker starts")
}

/// A minimal valid run context.
pub fn context(run_id: RunId, text: &str, deadline_at: Option<f64>) -> AgentRunContext {
    serde_json::from_value(json!({
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api"},
        "event": {"event_id": "e1", "event_type": "message.received", "source": "api"},
        "conversation": {"conversation_id": "conv-1"},
        "input": {"text": text},
        "delivery": {"surface": "api"},
        "resources": {},
        "context": {"inline_policy": {"mode": "current_event"}, "available_apis": {}},
        "runtime": {"trace_id": run_id.to_string(), "deadline_at": deadline_at},
    }))
    .expect("valid context")
}
