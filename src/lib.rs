//! The `switchboard` library: one process that runs any set of Switchboard roles, wired from
//! the configuration. The `switchboard` binary (`src/main.rs`, the CLI) and the end-to-end
//! harness (`sb-tests`) both start the system through it, so the tests drive exactly what a
//! user runs.
//!
//! # Layout
//! - [`embedded`]: [`embedded::start`] / [`embedded::start_with`] build the dependencies from
//!   a [`SwitchboardConfig`](sb_common::config::SwitchboardConfig) (database, bus, session
//!   store, topology), start the asked roles (all three for `switchboard dev`, one for
//!   `switchboard gateway|orchestrator|worker`), bootstrap a fresh data directory (workspace,
//!   API key, default agent), recover work the in-process bus lost in a crash, and drain
//!   in order on shutdown.
//! - [`builtin`]: the echo and local-agent runners built into the binary, the fallback
//!   `switchboard dev` uses when their standalone binaries have not been built
//!   (`cargo run -- dev`).
//! - [`default_agent`]: the model and default agent `switchboard dev` bootstraps
//!   (`--model-url`, `--model`: the local agent on that model; without: the echo runner).
//! - [`cli`]: the command line (`switchboard dev`, `send`, `keys`, …); `src/main.rs` only
//!   parses it and calls [`cli::run`], so every command is testable in-process.
//! - [`client`]: the HTTP client of a running gateway (`send`, `bench`, the operator
//!   commands, the tests).
//! - [`allocator`]: the allocators' tuning, applied first thing in `src/main.rs` (how long
//!   mimalloc keeps freed pages mapped; SQLite allocating from mimalloc).
//! - `testing` (feature `testing`): the in-memory host the end-to-end suites run on.

pub mod allocator;
pub mod builtin;
pub mod cli;
pub mod client;
pub mod default_agent;
pub mod embedded;
#[cfg(feature = "testing")]
pub mod testing;
