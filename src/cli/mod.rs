//! The command line: one binary, one subcommand per role or tool.
//!
//! Every subcommand takes `--config FILE` and the logging flags ([`ConfigArgs`]); its other
//! flags become configuration overrides, the last layer of the loader
//! (defaults → file → `SWITCHBOARD__*` environment → flags, see `sb_common::config`). A flag
//! that is not given leaves the value to the earlier layers, which is why flags have no clap
//! defaults of their own: their documented defaults are the configuration defaults.
//!
//! # Layout
//! - [`roles`]: `dev`, `gateway`, `orchestrator`, `worker` (the long-running processes).
//! - [`migrate`]: `migrate` (apply database migrations).
//! - [`keys`]: `keys create|list|revoke` (API keys and their roles, on the database or through
//!   the gateway).
//! - [`client`]: `send` and `bench` (HTTP clients of a running gateway): their flags;
//!   [`send`] and [`bench`] implement them on [`api`] (the gateway API client) and [`sse`]
//!   (the event-stream parser).
//! - [`resources`]: `models`, `tools`, `kb` (the resource registry, through the gateway).
//! - [`dlq`]: `dlq list|replay|purge` (the dead-letter queue of a cluster's bus).
//! - [`db`]: database connection helpers shared by the commands above.

pub mod api;
pub mod bench;
pub mod client;
pub mod cpu;
pub mod db;
pub mod dlq;
pub mod keys;
pub mod migrate;
pub mod resources;
pub mod roles;
pub mod send;
pub mod sse;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use sb_common::config::{ConfigLoader, OverrideValue, SwitchboardConfig};

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
    Dev(roles::DevArgs),
    /// Run the HTTP gateway (API, outbox relay, live delivery).
    Gateway(roles::GatewayArgs),
    /// Run the orchestrator (routing, result sink, scheduler, reaper).
    Orchestrator(roles::OrchestratorArgs),
    /// Run a worker (runner processes and their Host API).
    Worker(roles::WorkerArgs),
    /// Apply pending database migrations, then exit.
    Migrate(migrate::MigrateArgs),
    /// Send a message to a running gateway and print the streamed reply.
    Send(client::SendArgs),
    /// Manage API keys.
    Keys(keys::KeysArgs),
    /// Register and list models (through a running gateway).
    Models(resources::ModelsArgs),
    /// Register and list HTTP tools (through a running gateway).
    Tools(resources::ToolsArgs),
    /// Create knowledge bases and upload documents (through a running gateway).
    Kb(resources::KbArgs),
    /// Drive load against a running gateway; print throughput and latency percentiles.
    Bench(client::BenchArgs),
    /// Inspect, replay or purge the dead-letter queue of a cluster's message bus.
    Dlq(dlq::DlqArgs),
    /// Serve a runner built into this binary on stdin/stdout (started by the worker).
    #[command(hide = true)]
    Runner(roles::RunnerArgs),
}

/// Flags every subcommand accepts.
#[derive(Debug, Clone, Default, Args)]
pub struct ConfigArgs {
    /// Configuration file (TOML). Without it, ./switchboard.toml is read when present.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log filter, e.g. `debug` or `info,sb_worker=debug` (telemetry.log_level; RUST_LOG wins).
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Write logs as JSON lines (telemetry.json).
    #[arg(long)]
    pub log_json: bool,
}

/// Configuration overrides collected from a subcommand's flags, in the order given.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides(pub Vec<(String, OverrideValue)>);

impl Overrides {
    /// Sets `key` to a scalar.
    pub fn set(&mut self, key: &str, value: impl ToString) {
        self.0
            .push((key.to_owned(), OverrideValue::Text(value.to_string())));
    }

    /// Sets `key` to `value` when the flag was given.
    pub fn set_opt(&mut self, key: &str, value: Option<impl ToString>) {
        if let Some(value) = value {
            self.set(key, value);
        }
    }

    /// Sets a list-valued `key` when the repeatable flag was given at least once.
    pub fn set_list<T: ToString>(&mut self, key: &str, values: &[T]) {
        if !values.is_empty() {
            self.0.push((
                key.to_owned(),
                OverrideValue::List(values.iter().map(ToString::to_string).collect()),
            ));
        }
    }

    /// The value of the last override for `key`.
    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<&OverrideValue> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl ConfigArgs {
    /// The logging overrides.
    pub fn overrides(&self, out: &mut Overrides) {
        out.set_opt("telemetry.log_level", self.log_level.as_deref());
        if self.log_json {
            out.set("telemetry.json", true);
        }
    }

    /// Loads and validates the configuration: defaults, the file, the process environment,
    /// then `extra` (the subcommand's own flags) and the logging flags.
    pub fn load(&self, extra: Overrides) -> anyhow::Result<SwitchboardConfig> {
        let mut overrides = extra;
        self.overrides(&mut overrides);
        ConfigLoader::new()
            .file_opt(self.config.as_deref())
            .process_env()
            .overrides(overrides.0)
            .load()
            .context("configuration")
    }

    /// [`Self::load`], then installs logging from the loaded configuration.
    pub fn load_and_init_logging(&self, extra: Overrides) -> anyhow::Result<SwitchboardConfig> {
        let config = self.load(extra)?;
        sb_common::telemetry::init(&config.telemetry).context("logging")?;
        tracing::debug!(?config, "configuration loaded");
        Ok(config)
    }
}

/// Runs one subcommand to completion.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Dev(args) => roles::dev(args).await,
        Command::Gateway(args) => roles::gateway(args).await,
        Command::Orchestrator(args) => roles::orchestrator(args).await,
        Command::Worker(args) => roles::worker(args).await,
        Command::Migrate(args) => migrate::run(args).await,
        Command::Send(args) => client::send(args).await,
        Command::Keys(args) => keys::run(args).await,
        Command::Models(args) => resources::models(args).await,
        Command::Tools(args) => resources::tools(args).await,
        Command::Kb(args) => resources::kb(args).await,
        Command::Bench(args) => client::bench(args).await,
        Command::Dlq(args) => dlq::run(args).await,
        Command::Runner(args) => roles::runner(args).await,
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

    #[test]
    fn logging_flags_become_overrides() {
        let args = ConfigArgs {
            config: None,
            log_level: Some("debug".into()),
            log_json: true,
        };
        let mut o = Overrides::default();
        args.overrides(&mut o);
        assert_eq!(
            o.get("telemetry.log_level"),
            Some(&OverrideValue::Text("debug".into()))
        );
        assert_eq!(
            o.get("telemetry.json"),
            Some(&OverrideValue::Text("true".into()))
        );
        let mut none = Overrides::default();
        ConfigArgs::default().overrides(&mut none);
        assert!(none.0.is_empty());
    }

    #[test]
    fn missing_config_file_is_an_error() {
        let args = ConfigArgs {
            config: Some("/nonexistent/switchboard.toml".into()),
            ..Default::default()
        };
        let err = args.load(Overrides::default()).unwrap_err();
        assert!(format!("{err:#}").contains("does not exist"), "{err:#}");
    }
}
