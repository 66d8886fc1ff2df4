//! The long-running role commands: `dev`, `gateway`, `orchestrator`, `worker`.
//!
//! Each one loads and validates the configuration (its flags are the last override layer),
//! installs logging, then runs the role(s) until ctrl-c / SIGTERM.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

use super::db::sqlite_url_for_file;
use super::{ConfigArgs, Overrides};

/// File name of the ledger inside the `dev` data directory.
pub const DEV_DATABASE_FILE: &str = "switchboard.db";

/// `switchboard dev`.
#[derive(Debug, Clone, Args)]
pub struct DevArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Directory holding the SQLite ledger (`<DIR>/switchboard.db`); created if missing.
    /// Without it, database.url applies (default: ./.switchboard/switchboard.db).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Address the HTTP API listens on [default: 127.0.0.1:8080] (gateway.http_addr).
    #[arg(long, value_name = "ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Directory with runner plugins; repeat for several [default: ./runners]
    /// (worker.runners_dirs).
    #[arg(long = "runners-dir", value_name = "DIR")]
    pub runners_dirs: Vec<PathBuf>,
}

impl DevArgs {
    /// The configuration overrides of `dev`: embedded bus and session store always (one
    /// process), plus the given flags.
    pub fn overrides(&self) -> anyhow::Result<Overrides> {
        let mut o = Overrides::default();
        o.set("bus.kind", "memory");
        o.set("sessions.kind", "memory");
        if let Some(dir) = &self.data_dir {
            o.set(
                "database.url",
                sqlite_url_for_file(&dir.join(DEV_DATABASE_FILE))?,
            );
        }
        o.set_opt("gateway.http_addr", self.http_addr);
        o.set_list("worker.runners_dirs", &display_paths(&self.runners_dirs));
        Ok(o)
    }
}

/// `switchboard gateway`.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Address the HTTP API listens on (gateway.http_addr).
    #[arg(long, value_name = "ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Ledger database URL (database.url).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl GatewayArgs {
    /// The configuration overrides of `gateway`.
    pub fn overrides(&self) -> Overrides {
        let mut o = Overrides::default();
        o.set_opt("gateway.http_addr", self.http_addr);
        o.set_opt("database.url", self.database_url.as_deref());
        o
    }
}

/// `switchboard orchestrator`.
#[derive(Debug, Clone, Args)]
pub struct OrchestratorArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Ledger database URL (database.url).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl OrchestratorArgs {
    /// The configuration overrides of `orchestrator`.
    pub fn overrides(&self) -> Overrides {
        let mut o = Overrides::default();
        o.set_opt("database.url", self.database_url.as_deref());
        o
    }
}

/// `switchboard worker`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Stable worker id used in leases and logs (worker.id) [default: generated].
    #[arg(long, value_name = "ID")]
    pub worker_id: Option<String>,
    /// Pool to consume jobs from; repeat for several [default: default] (worker.pools).
    #[arg(long = "pool", value_name = "POOL")]
    pub pools: Vec<String>,
    /// Concurrent runs (worker.slots) [default: 16].
    #[arg(long, value_name = "N")]
    pub slots: Option<u32>,
    /// Directory with runner plugins; repeat for several [default: ./runners]
    /// (worker.runners_dirs).
    #[arg(long = "runners-dir", value_name = "DIR")]
    pub runners_dirs: Vec<PathBuf>,
    /// Ledger database URL (database.url).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl WorkerArgs {
    /// The configuration overrides of `worker`.
    pub fn overrides(&self) -> Overrides {
        let mut o = Overrides::default();
        o.set_opt("worker.id", self.worker_id.as_deref());
        o.set_list("worker.pools", &self.pools);
        o.set_opt("worker.slots", self.slots);
        o.set_list("worker.runners_dirs", &display_paths(&self.runners_dirs));
        o.set_opt("database.url", self.database_url.as_deref());
        o
    }
}

fn display_paths(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| Path::display(p).to_string()).collect()
}

/// The error of a role command whose role crate is not connected to the CLI yet.
fn not_wired(command: &str) -> anyhow::Error {
    anyhow::anyhow!("`switchboard {command}` is not yet wired to its role crate")
}

/// Runs gateway, orchestrator and worker in this process.
pub async fn dev(args: DevArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(args.overrides()?)?;
    Err(not_wired("dev"))
}

/// Runs the gateway.
pub async fn gateway(args: GatewayArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(args.overrides())?;
    Err(not_wired("gateway"))
}

/// Runs the orchestrator.
pub async fn orchestrator(args: OrchestratorArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(args.overrides())?;
    Err(not_wired("orchestrator"))
}

/// Runs a worker.
pub async fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(args.overrides())?;
    Err(not_wired("worker"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use sb_common::config::{BusKind, ConfigLoader, SessionsKind};

    fn dev_args(argv: &[&str]) -> DevArgs {
        let mut full = vec!["switchboard", "dev"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Dev(a) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn dev_without_flags_forces_embedded_backends_only() {
        let o = dev_args(&[]).overrides().unwrap();
        let config = ConfigLoader::new()
            .without_file()
            .env([
                ("SWITCHBOARD__BUS__KIND", "amqp"),
                ("SWITCHBOARD__BUS__URL", "amqp://rabbit"),
                ("SWITCHBOARD__GATEWAY__HTTP_ADDR", "127.0.0.1:9999"),
            ])
            .overrides(o.0)
            .load()
            .unwrap();
        assert_eq!(config.bus.kind, BusKind::Memory);
        assert_eq!(config.sessions.kind, SessionsKind::Memory);
        // Flags not given leave earlier layers alone.
        assert_eq!(config.gateway.http_addr.port(), 9999);
        assert_eq!(config.worker.runners_dirs, [PathBuf::from("runners")]);
    }

    #[test]
    fn dev_flags_map_onto_config() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data dir");
        let o = dev_args(&[
            "--data-dir",
            data.to_str().unwrap(),
            "--http-addr",
            "0.0.0.0:8081",
            "--runners-dir",
            "a",
            "--runners-dir",
            "b,c",
        ])
        .overrides()
        .unwrap();
        let config = ConfigLoader::new()
            .without_file()
            .overrides(o.0)
            .load()
            .unwrap();
        assert_eq!(config.gateway.http_addr.to_string(), "0.0.0.0:8081");
        assert_eq!(
            config.worker.runners_dirs,
            [PathBuf::from("a"), PathBuf::from("b,c")]
        );
        let url = config.database.url.expose();
        assert!(url.starts_with("sqlite://"), "{url}");
        assert!(
            url.ends_with("/data%20dir/switchboard.db?mode=rwc"),
            "{url}"
        );
        assert_eq!(
            crate::cli::db::sqlite_file(url).unwrap(),
            data.join(DEV_DATABASE_FILE)
        );
    }

    #[test]
    fn dev_rejects_a_bad_http_addr_at_parse_time() {
        let mut argv = vec!["switchboard", "dev", "--http-addr", "nowhere"];
        assert!(Cli::try_parse_from(&argv).is_err());
        argv.truncate(2);
        assert!(Cli::try_parse_from(&argv).is_ok());
    }

    #[test]
    fn worker_flags_map_onto_config() {
        let cli = Cli::try_parse_from([
            "switchboard",
            "worker",
            "--worker-id",
            "w1",
            "--pool",
            "default",
            "--pool",
            "gpu",
            "--slots",
            "4",
            "--database-url",
            "postgres://postgres@127.0.0.1:5432/test",
        ])
        .unwrap();
        let Command::Worker(args) = cli.command else {
            panic!()
        };
        let config = ConfigLoader::new()
            .without_file()
            .overrides(args.overrides().0)
            .load()
            .unwrap();
        assert_eq!(config.worker.id.as_deref(), Some("w1"));
        assert_eq!(config.worker.pools, ["default", "gpu"]);
        assert_eq!(config.worker.slots.get(), 4);
        assert_eq!(config.database.url.scheme().as_deref(), Some("postgres"));
    }

    #[test]
    fn gateway_and_orchestrator_flags_map_onto_config() {
        let cli = Cli::try_parse_from([
            "switchboard",
            "gateway",
            "--http-addr",
            "0.0.0.0:80",
            "--database-url",
            "postgres://db/x",
        ])
        .unwrap();
        let Command::Gateway(args) = cli.command else {
            panic!()
        };
        let o = args.overrides();
        let config = ConfigLoader::new()
            .without_file()
            .overrides(o.0)
            .load()
            .unwrap();
        assert_eq!(config.gateway.http_addr.port(), 80);
        assert_eq!(config.database.url.expose(), "postgres://db/x");

        let cli = Cli::try_parse_from([
            "switchboard",
            "orchestrator",
            "--database-url",
            "mysql://nope",
        ])
        .unwrap();
        let Command::Orchestrator(args) = cli.command else {
            panic!()
        };
        // The flag is applied, and validation rejects it before anything connects.
        let err = ConfigLoader::new()
            .without_file()
            .overrides(args.overrides().0)
            .load()
            .unwrap_err();
        assert_eq!(err.problems()[0].key, "database.url");
    }
}
