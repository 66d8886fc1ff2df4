//! Switchboard worker: consumes run jobs, hosts runner processes, carries their Host API calls
//! and publishes their sequenced results (SPEC §2 step 3, §4, §8, §11).
//!
//! A worker serves one or more pools (`switchboard.runs.<pool>`). At start it loads the runner
//! plugins it finds on disk, registers the runners of its pools in the `runners` table (the
//! orchestrator routes and authorizes from there), and starts one [`runner::RunnerHost`] per
//! runner. Each job is claimed in the run ledger (exactly one worker wins), guarded by a
//! heartbeat lease in the session store, executed on the runner host, and its results are
//! handed on in order: to the worker's [`outlet::ResultOutlet`] when it has one (the
//! `switchboard` binary gives it the result sink, which stores them in this process), else
//! published to `switchboard.results`; at the end the run's session is removed so
//! the run's Host API closes, and the job is acknowledged. Runner processes reach the host
//! only through the Host API of [`sb_host_api`] (`ApiGate` in front of `ActionDispatcher`),
//! which checks every call against the run's frozen session before any action code runs; the
//! worker is its stdio transport, as the gateway is its HTTP one.
//!
//! Runners are untrusted code (SPEC §14): the worker makes itself non-dumpable at start,
//! runs each runner process confined ([`runner::sandbox`]: unprivileged user, `no_new_privs`,
//! resource limits, private `TMPDIR`), keeps a shared runner process per workspace, and
//! redacts runner stderr before logging it ([`runner::redact`]).
//!
//! # Layout
//! - [`service`]: [`service::Worker`] — job consumer, claim/lease/interrupt decisions, result
//!   publishing, cancel via the control queue, drain on shutdown. It builds the Host API
//!   (`sb_host_api::ApiGate` over `sb_host_api::ActionDispatcher`, or the dispatcher given
//!   in [`WorkerOptions`]) and injects it into every runner host.
//! - [`outlet`]: [`outlet::ResultOutlet`], the seam through which a worker may hand its
//!   runs' items to a result sink in its own process instead of the results queue.
//! - [`plugins`]: runner plugin manifests on disk → [`plugins::PluginRunner`]s.
//! - [`runner`]: runner processes: framing, spawning, the protocol state machine of the
//!   link to each process ([`runner::link::RunnerLink`]) and [`runner::RunnerHost`], which
//!   turns a run request into an ordered result stream and carries each process's Host API
//!   calls (the stdio transport) to the injected `sb_host_api::HostApi`.
//! - [`sequencer`]: per-run result validation and transport sequencing (pure).
//!
//! The Host API itself (the gate, the actions, the model and tool providers) is not here: it
//! lives in `sb_host_api`, which the gateway's HTTP transport shares.

mod lock;
pub mod outlet;
pub mod plugins;
pub mod runner;
pub mod sequencer;
pub mod service;

pub use service::{Worker, WorkerDeps, WorkerError, WorkerHandle, WorkerOptions, WorkerReport};
