//! The command line: one binary, one subcommand per role or tool.
//!
//! Every subcommand takes `--config FILE` and the logging flags ([`config::ConfigArgs`]); its
//! other flags become configuration overrides, the last layer of the loader
//! (defaults → file → `SWITCHBOARD__*` environment → flags, see `sb_common::config`). A flag
//! that is not given leaves the value to the earlier layers, which is why flags have no clap
//! defaults of their own: their documented defaults are the configuration defaults.
//!
//! # Layout
//! - [`dev`]: `dev` (every role in one process); [`roles`]: `gateway`, `orchestrator`,
//!   `worker` (one role each); [`lifecycle`]: what the long-running commands share;
//!   [`runner`]: the hidden `runner` (a runner built into the binary).
//! - [`migrate`]: `migrate` (apply database migrations).
//! - [`keys`]: `keys create|list|revoke` (API keys and their roles, on the database or through
//!   the gateway).
//! - [`send`], [`bench`](mod@bench): `send` and `bench` (HTTP clients of a running gateway), on the
//!   library's gateway client ([`crate::client`]).
//! - [`resources`]: `models`, `tools`, `kb`, `schedules` (the resource registry and the
//!   schedules, through the gateway).
//! - [`ops`]: `runs list|show|tail`, `agents` (the operator's view of a gateway), on
//!   [`output`] (tables, `--json`, colours, progress, names or ids).
//! - [`service`]: `sessions`, `turns` (the service API of sessions and turns).
//! - [`dlq`]: `dlq list|replay|purge` (the dead-letter queue of a cluster's bus).
//! - [`config`]: the flags every subcommand shares (`--config`, logging) and the overrides
//!   the others become; [`gateway`]: the flags and the client of every gateway command.
//! - [`db`]: database connection helpers shared by the commands above.
//! - [`runtime`]: the Tokio runtime `src/main.rs` builds before running a command.
//!
//! Each command's clap arguments sit beside the command; this file only assembles them into
//! [`Cli`] and dispatches. No command imports this file back: what they share lives in
//! [`config`], [`gateway`], [`lifecycle`], [`output`] and [`db`].

pub mod bench;
pub mod config;
pub mod cpu;
pub mod db;
pub mod dev;
pub mod dlq;
pub mod gateway;
pub mod keys;
pub mod lifecycle;
pub mod migrate;
pub mod ops;
pub mod output;
pub mod resources;
pub mod roles;
pub mod runner;
pub mod runtime;
pub mod send;
pub mod service;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Switchboard agent host.
///
/// Run `switchboard dev` to start everything in one process on embedded defaults (SQLite in
/// ./.switchboard, in-process bus and session store), then `switchboard send "hello"`.
#[derive(Debug, Parser)]
#[command(name = "switchboard", version, about, long_about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run gateway, orchestrator and worker in one process on embedded backends.
    Dev(dev::DevArgs),
    /// Run the HTTP gateway (API, outbox relay, live delivery).
    Gateway(roles::GatewayArgs),
    /// Run the orchestrator (routing, result sink, scheduler, reaper).
    Orchestrator(roles::OrchestratorArgs),
    /// Run a worker (runner processes and their Host API).
    Worker(roles::WorkerArgs),
    /// Apply pending database migrations, then exit.
    Migrate(migrate::MigrateArgs),
    /// Send a message to a running gateway and print the streamed reply.
    Send(send::SendArgs),
    /// Manage API keys.
    Keys(keys::KeysArgs),
    /// Register and list models (through a running gateway).
    Models(resources::ModelsArgs),
    /// Register and list HTTP tools (through a running gateway).
    Tools(resources::ToolsArgs),
    /// Create knowledge bases and upload documents (through a running gateway).
    Kb(resources::KbArgs),
    /// Create, edit, pause, resume and delete schedules (through a running gateway).
    Schedules(resources::SchedulesArgs),
    /// List, inspect and follow runs live (through a running gateway).
    Runs(ops::RunsArgs),
    /// List, create and delete agents (through a running gateway).
    Agents(ops::AgentsArgs),
    /// Create, list and close sessions of the service API (through a running gateway).
    Sessions(service::SessionsArgs),
    /// Start, wait for, read and cancel turns of a session (through a running gateway).
    Turns(service::TurnsArgs),
    /// Drive load against a running gateway; print throughput and latency percentiles.
    Bench(bench::BenchArgs),
    /// Inspect, replay or purge the dead-letter queue of a cluster's message bus.
    Dlq(dlq::DlqArgs),
    /// Serve a runner built into this binary on stdin/stdout (started by the worker).
    #[command(hide = true)]
    Runner(runner::RunnerArgs),
}

/// Runs one subcommand to completion.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Dev(args) => dev::dev(args).await,
        Command::Gateway(args) => roles::gateway(args).await,
        Command::Orchestrator(args) => roles::orchestrator(args).await,
        Command::Worker(args) => roles::worker(args).await,
        Command::Migrate(args) => migrate::run(args).await,
        Command::Send(args) => send::send(args).await,
        Command::Keys(args) => keys::run(args).await,
        Command::Models(args) => resources::models(args).await,
        Command::Tools(args) => resources::tools(args).await,
        Command::Kb(args) => resources::kb(args).await,
        Command::Schedules(args) => resources::schedules(args).await,
        Command::Runs(args) => ops::runs(args).await,
        Command::Agents(args) => ops::agents(args).await,
        Command::Sessions(args) => service::sessions(args).await,
        Command::Turns(args) => service::turns(args).await,
        Command::Bench(args) => bench::bench(args).await,
        Command::Dlq(args) => dlq::run(args).await,
        Command::Runner(args) => runner::runner(args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_subcommand_takes_config() {
        for sub in [
            "dev",
            "gateway",
            "orchestrator",
            "worker",
            "migrate",
            "send",
            "bench",
        ] {
            let mut argv = vec!["switchboard", sub, "--config", "x.toml"];
            if sub == "send" {
                argv.push("hi");
            }
            Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{sub}: {e}"));
        }
        Cli::try_parse_from(["switchboard", "keys", "create", "--config", "x.toml"]).unwrap();
    }
}
