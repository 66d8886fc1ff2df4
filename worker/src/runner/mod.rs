//! Hosting runner processes (SPEC §4): framing, processes, the per-connection state machine
//! and the [`RunnerHost`] that ties them together.
//!
//! # Layout
//! - [`codec`]: JSON-lines framing with the line cap, `RunnerConnection`.
//! - [`process`]: spawn (cleared env, own process group), stderr capture, group kill.
//! - [`session`]: the pure per-process state machine (`Starting → Running → Draining →
//!   Exited`) and its effects.
//! - [`host`]: [`RunnerHost`] (shared / per_run process management, restart backoff,
//!   deadlines, cancel) and [`RunHandle`] (the ordered result stream of one run).
//! - [`api`]: [`HostApi`], the injected Host API dispatcher, and [`BasicHostApi`].
//! - [`error`]: the start errors ([`RunnerError`]).

pub mod api;
pub mod codec;
pub mod error;
pub mod host;
pub mod process;
pub mod session;

#[cfg(test)]
pub(crate) mod testing;

pub use api::{ApiStream, BasicHostApi, CallerIdentity, HostApi};
pub use error::RunnerError;
pub use host::{EnvLookup, RunHandle, RunRequest, RunnerHost, RunnerHostConfig, RunnerSpec};
pub use session::ExecutionMode;
