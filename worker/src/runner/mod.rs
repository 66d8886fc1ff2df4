//! Hosting runner processes (SPEC §4): framing, processes, the per-connection state machine
//! and the [`RunnerHost`] that ties them together.
//!
//! # Layout
//! - [`codec`]: JSON-lines framing with the line cap, `RunnerConnection`.
//! - [`process`]: spawn (cleared env, own process group, confined), stderr capture, group
//!   kill.
//! - [`sandbox`]: confinement of runner processes (user, `no_new_privs`, resource limits,
//!   private `TMPDIR`) and the non-dumpable worker (SPEC §14).
//! - [`redact`]: structural redaction of runner stderr before it is logged.
//! - [`link`]: [`link::RunnerLink`], the pure protocol state machine of the link to one runner
//!   process (`Starting → Running → Draining → Exited`) and its effects.
//! - [`host`]: [`RunnerHost`] (shared / per_run process management, restart backoff,
//!   deadlines, cancel) and [`RunHandle`] (the ordered result stream of one run). Each
//!   process's calls go to an injected `sb_host_api::HostApi`, with the process's
//!   `sb_host_api::Connection` as the caller's.
//! - [`error`]: the start errors ([`RunnerError`]).

pub mod codec;
pub mod error;
pub mod host;
pub mod link;
pub mod process;
pub mod redact;
pub mod sandbox;

#[cfg(test)]
pub(crate) mod testing;

pub use error::RunnerError;
pub use host::{EnvLookup, RunHandle, RunRequest, RunnerHost, RunnerHostOptions, RunnerSpec};
pub use link::ExecutionMode;
pub use sandbox::{SandboxError, make_undumpable};
