//! Everything `Worker::spawn_with` does before the worker runs: the worker made
//! non-dumpable, the runner plugins loaded, the runners of its pools registered and a
//! [`RunnerHost`] built for each behind the Host API gate, the topology declared, the runs
//! queues and the control queue subscribed.
//!
//! # Cancel messages
//! The worker's exclusive control queue is bound to `cancel.*` once, at start, and a cancel
//! for a run this worker does not hold is acked and ignored. Binding `cancel.<run_id>` per
//! run instead would put two broker round trips (bind before the run starts, unbind after)
//! and a broker metadata change on every run's path, to save every worker from seeing cancel
//! messages, which are rare (user cancels, the `interrupt` policy). With the binding in place
//! from the start there is also no window in which a cancel published for a just-claimed run
//! reaches nobody; the session-store cancel flag still covers a run cancelled before any
//! worker took its job.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use chrono::Utc;
use sb_common::bus::topology::{CONTROL_ALL_PATTERN, declare_topology};
use sb_common::bus::{Binding, ConsumeOptions};
use sb_common::config::SwitchboardConfig;
use sb_common::session::announce_routing_change;
use sb_common::shutdown::Shutdown;
use sb_protocol::host::AgentRunnerDescriptor;
use sb_protocol::manifest::RunnerId;
use sb_protocol::result::ResultLimits;
use sb_store::RunnerRow;
use serde_json::json;

use super::deps::{WorkerDeps, WorkerOptions};
use super::error::WorkerError;
use super::job::Core;
use super::loops::Subscribed;
use crate::plugins::{PluginRunner, bundled_runners_dir, load_plugins};
use crate::runner::{RunnerHost, RunnerHostOptions, make_undumpable};
use sb_host_api::actions::{ActionDispatcher, ActionLimits};
use sb_host_api::api::HostApi;
use sb_host_api::api_gate::ApiGate;

/// Prefetch of the control queue (cancel messages are tiny and handled inline).
const CONTROL_PREFETCH: u16 = 64;

/// Everything `Worker::spawn_with` does before the worker runs.
pub(super) async fn start(
    id: String,
    deps: WorkerDeps,
    options: WorkerOptions,
    shutdown: &Shutdown,
) -> Result<(Arc<Core>, Vec<Subscribed>, Subscribed, Vec<RunnerId>), WorkerError> {
    // Before any runner exists: from here on no same-user process can read this process's
    // memory or environment (the bus, Redis and database credentials). Every deployment —
    // `switchboard worker` and the embedded `switchboard dev` — starts its worker here.
    make_undumpable()?;
    let config = deps.config.worker.clone();
    let dirs = plugin_dirs(&config.runners_dirs, options.bundled_runners);
    let report = load_plugins(&dirs, &options.command_lookup);
    let dispatcher = options.dispatcher.clone().unwrap_or_else(|| {
        let limits = ActionLimits::from_config(&deps.config.limits);
        let providers = sb_host_api::providers::ProviderOptions::of(&deps.config);
        Arc::new(
            ActionDispatcher::new(deps.stores.clone(), deps.sessions.clone(), limits)
                .with_provider_options(providers),
        )
    });
    let gate: Arc<dyn HostApi> = Arc::new(ApiGate::new(deps.sessions.clone(), dispatcher));
    let host_config = host_config(&deps.config);
    let mut hosts = HashMap::new();
    for runner in report.runners {
        if !config.pools.contains(&runner.execution.pool) {
            tracing::info!(runner_id = %runner.runner_id, pool = %runner.execution.pool, "runner belongs to a pool this worker does not serve; not hosted");
            continue;
        }
        let row = runner_row(&runner)?;
        deps.stores
            .runners
            .upsert(row)
            .await
            .map_err(|source| WorkerError::Register {
                runner_id: runner.runner_id.to_string(),
                source,
            })?;
        tracing::info!(runner_id = %runner.runner_id, pool = %runner.execution.pool, program = %runner.program.display(), "runner registered");
        hosts.insert(
            runner.runner_id.clone(),
            RunnerHost::new(runner.runner_spec(), host_config.clone(), gate.clone()),
        );
    }
    if hosts.is_empty() {
        tracing::warn!(dirs = ?dirs, pools = ?config.pools, "no runner to host: every job will fail with runner.error");
    } else if let Err(error) = announce_routing_change(deps.sessions.as_ref()).await {
        // The registrations are committed; routing caches see them within their max age.
        tracing::warn!(%error, "could not announce the runner registrations to the routing caches");
    }

    declare_topology(deps.bus.as_ref(), deps.topology.options())
        .await
        .map_err(|source| WorkerError::Bus {
            what: "the bus topology".into(),
            source,
        })?;
    let control_spec = deps.topology.control_queue(&id);
    let control = deps
        .bus
        .subscribe(&control_spec, ConsumeOptions::prefetch(CONTROL_PREFETCH))
        .await
        .map_err(|source| WorkerError::Bus {
            what: control_spec.name.clone(),
            source,
        })?;
    // Every cancel message, once (see "Cancel messages" in the module docs).
    let every_cancel = Binding::new(deps.topology.control_exchange(), CONTROL_ALL_PATTERN);
    deps.bus
        .bind(&control_spec.name, &every_cancel)
        .await
        .map_err(|source| WorkerError::Bus {
            what: format!("{} binding {CONTROL_ALL_PATTERN}", control_spec.name),
            source,
        })?;
    let prefetch = u16::try_from(config.slots.get()).unwrap_or(u16::MAX);
    let mut jobs = Vec::new();
    for pool in &config.pools {
        let spec = deps.topology.runs_queue(pool);
        let sub = deps
            .bus
            .subscribe(&spec, ConsumeOptions::prefetch(prefetch))
            .await
            .map_err(|source| WorkerError::Bus {
                what: spec.name.clone(),
                source,
            })?;
        jobs.push(Subscribed {
            queue: spec,
            prefetch,
            subscription: sub,
        });
    }

    let control = Subscribed {
        queue: control_spec.bind(deps.topology.control_exchange(), CONTROL_ALL_PATTERN),
        prefetch: CONTROL_PREFETCH,
        subscription: control,
    };
    let mut runners: Vec<RunnerId> = hosts.keys().cloned().collect();
    runners.sort();
    let core = Arc::new(Core::new(
        id,
        deps,
        config,
        hosts,
        options.outlet,
        shutdown.token(),
    ));
    tracing::info!(runners = runners.len(), pools = ?core.config.pools, slots = core.config.slots.get(), "worker started");
    Ok((core, jobs, control, runners))
}

/// The configured plugin directories, then the bundled one (unless already listed).
fn plugin_dirs(configured: &[PathBuf], bundled: bool) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = configured.to_vec();
    if bundled {
        if let Some(dir) = bundled_runners_dir(None) {
            let canonical = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            let known = dirs.iter().any(|d| canonical(d) == canonical(&dir));
            if !known {
                dirs.push(dir);
            }
        }
    }
    dirs
}

/// The runner host tuning from the worker and limits sections.
fn host_config(config: &SwitchboardConfig) -> RunnerHostOptions {
    let worker = &config.worker;
    let defaults = RunnerHostOptions::default();
    RunnerHostOptions {
        max_line_bytes: worker.max_line_bytes.get(),
        result_limits: ResultLimits {
            max_result_bytes: worker.max_result_bytes.get(),
            max_inline_artifact_bytes: config.limits.artifact_inline_bytes.get(),
            ..ResultLimits::default()
        },
        run_items_max: config.limits.run_items_max,
        cancel_grace: worker.cancel_grace,
        // SIGTERM → SIGKILL gets the same grace as a cooperative cancel.
        kill_grace: worker.cancel_grace,
        stderr: crate::runner::process::StderrOptions {
            max_line_bytes: worker.stderr_cap_bytes.get(),
            ..defaults.stderr
        },
        sandbox: worker.sandbox.clone(),
        ..defaults
    }
}

/// The `runners` table row of a loaded runner.
fn runner_row(runner: &PluginRunner) -> Result<RunnerRow, WorkerError> {
    let raw_manifest = json!({
        "plugin": {
            "author": runner.plugin.author,
            "name": runner.plugin.name,
            "version": runner.plugin.version,
        },
        "runner": runner.manifest,
        "execution": {
            "mode": runner.execution.mode,
            "max_concurrency": runner.execution.max_concurrency.get(),
            "pool": runner.execution.pool,
        },
    });
    let descriptor = AgentRunnerDescriptor::from_manifest(
        &runner.manifest,
        Some(runner.plugin.version.clone()),
        runner.execution.pool.clone(),
        raw_manifest,
    )
    .map_err(|e| WorkerError::Descriptor {
        runner_id: runner.runner_id.to_string(),
        reason: e.to_string(),
    })?;
    let descriptor_json =
        serde_json::to_value(&descriptor).map_err(|e| WorkerError::Descriptor {
            runner_id: runner.runner_id.to_string(),
            reason: e.to_string(),
        })?;
    Ok(RunnerRow {
        id: runner.runner_id.to_string(),
        plugin_id: runner.runner_id.plugin_id(),
        pool: runner.execution.pool.clone(),
        version: runner.plugin.version.clone(),
        descriptor: descriptor_json,
        seen_at: Utc::now(),
    })
}
