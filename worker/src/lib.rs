//! Switchboard worker: consumes run jobs, hosts runner processes, serves their Host API calls
//! and publishes their sequenced results (SPEC §2 step 3, §4, §8, §11).
//!
//! A worker serves one or more pools (`switchboard.runs.<pool>`). At start it loads the runner
//! plugins it finds on disk, registers the runners of its pools in the `runners` table (the
//! orchestrator routes and authorizes from there), and starts one [`runner::RunnerHost`] per
//! runner. Each job is claimed in the run ledger (exactly one worker wins), guarded by a
//! heartbeat lease in the session store, executed on the runner host, and its results are
//! published in order to `switchboard.results`; at the end the run's session is removed so
//! the run's Host API closes, and the job is acknowledged. Runner processes reach the host
//! only through [`api_gate::ApiGate`], which checks every call against the run's frozen
//! session before any action code runs.
//!
//! Runners are untrusted code (SPEC §14): the worker makes itself non-dumpable at start,
//! runs each runner process confined ([`runner::sandbox`]: unprivileged user, `no_new_privs`,
//! resource limits, private `TMPDIR`), keeps a shared runner process per workspace, and
//! redacts runner stderr before logging it ([`runner::redact`]).
//!
//! # Layout
//! - [`actions`]: [`actions::ActionDispatcher`] — the Host API actions (history, events,
//!   artifacts, state, storage, steering, models, tools, knowledge) behind the gate.
//! - [`service`]: [`service::Worker`] — job consumer, claim/lease/interrupt decisions, result
//!   publishing, cancel via the control queue, drain on shutdown.
//! - [`api_gate`]: [`api_gate::ApiGate`] — the Host API gate (session, identity, deadline)
//!   in front of a [`api_gate::Dispatcher`] that serves the actions.
//! - [`plugins`]: runner plugin manifests on disk → [`plugins::PluginRunner`]s.
//! - [`providers`]: clients of the model providers (OpenAI-compatible chat, SSE streams,
//!   rerank) and HTTP tools behind the resource actions.
//! - [`runner`]: runner processes: framing, spawning, the protocol state machine of the
//!   link to each process ([`runner::link::RunnerLink`]) and [`runner::RunnerHost`], which
//!   turns a run request into an ordered result stream.
//! - [`sequencer`]: per-run result validation and transport sequencing (pure).

pub mod actions;
pub mod api_gate;
mod lock;
pub mod plugins;
pub mod providers;
pub mod runner;
pub mod sequencer;
pub mod service;

pub use service::{Worker, WorkerDeps, WorkerError, WorkerHandle, WorkerOptions, WorkerReport};
