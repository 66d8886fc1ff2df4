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
//! - [`builtin`]: the echo runner built into the binary, the fallback `switchboard dev` uses
//!   when the standalone `echo` runner binary has not been built (`cargo run -- dev`).

pub mod builtin;
pub mod embedded;
