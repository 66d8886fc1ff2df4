//! The single-role commands: `gateway`, `orchestrator`, `worker`.
//!
//! Each one loads and validates the configuration (its flags are the last override layer),
//! installs logging, then runs its role with [`crate::embedded`] until ctrl-c / SIGTERM, and
//! drains in pipeline order (a second ctrl-c exits at once). They run one role on the shared
//! backends (RabbitMQ, Redis) and refuse the in-process ones, which cannot connect separate
//! processes. `dev` (every role in one process) is [`crate::cli::dev`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use sb_common::config::{BusKind, SecretUrl, SessionsKind, SwitchboardConfig};
use sb_common::shutdown::Shutdown;

use crate::cli::config::{ConfigArgs, Overrides, display_paths};
use crate::cli::lifecycle::{exit_code, exit_on_second_signal};
use crate::embedded::{self, Bootstrap, EmbeddedOptions, Roles};

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
    /// Bootstrap workspace `default` at start, as `switchboard dev` does: an admin API key in
    /// DIR/api-key (created when the file is missing or holds no valid key) and the default
    /// agent (the echo runner, or the local agent on the `[dev]` model) when the workspace
    /// has none. The compose cluster uses it so that its first `switchboard send` is answered.
    #[arg(long, value_name = "DIR")]
    pub bootstrap_dir: Option<PathBuf>,
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

/// Runs the gateway.
pub async fn gateway(args: GatewayArgs) -> anyhow::Result<ExitCode> {
    let config = args.config.load_and_init_logging(args.overrides())?;
    let mut options = EmbeddedOptions::roles(Roles::GATEWAY);
    options.bootstrap = args.bootstrap_dir.as_deref().map(Bootstrap::new);
    run_role(config, options).await
}

/// Runs the orchestrator.
pub async fn orchestrator(args: OrchestratorArgs) -> anyhow::Result<ExitCode> {
    let config = args.config.load_and_init_logging(args.overrides())?;
    run_role(config, EmbeddedOptions::roles(Roles::ORCHESTRATOR)).await
}

/// Runs a worker.
pub async fn worker(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    let config = args.config.load_and_init_logging(args.overrides())?;
    run_role(config, EmbeddedOptions::roles(Roles::WORKER)).await
}

/// One role in this process, on backends shared with the other processes.
async fn run_role(config: SwitchboardConfig, options: EmbeddedOptions) -> anyhow::Result<ExitCode> {
    let roles = options.roles;
    require_shared_backends(&config, roles)?;
    for warning in unauthenticated_backends(&config) {
        tracing::warn!("{warning}");
    }
    let shutdown = Shutdown::new();
    shutdown.listen_for_signals()?;
    let embedded = embedded::start_with(config, options, shutdown.clone())
        .await
        .with_context(|| format!("cannot start the {}", roles.names()))?;
    if let Some(report) = embedded.bootstrap() {
        tracing::info!(
            api_key_file = %report.api_key_file.display(),
            created = report.api_key_created,
            default_agent = ?report.default_agent,
            "workspace default bootstrapped"
        );
    }
    if let Some(url) = embedded.base_url() {
        tracing::info!(%url, "gateway ready");
    }
    if !embedded.runners().is_empty() {
        let runners: Vec<String> = embedded.runners().iter().map(ToString::to_string).collect();
        tracing::info!(runners = %runners.join(", "), "worker ready");
    }
    exit_on_second_signal(&shutdown);
    Ok(exit_code(&embedded.wait().await))
}

/// The shared backends a cluster reaches without credentials of its own: Redis without a
/// password, RabbitMQ as its default `guest`. Any process that can connect to them (a
/// runner, another tenant's container) could then read and rewrite run sessions or inject
/// jobs; SECURITY.md says how to require credentials. Warned, not refused: a developer's
/// local cluster (`scripts/cluster`) runs on such services.
fn unauthenticated_backends(config: &SwitchboardConfig) -> Vec<String> {
    let mut warnings = Vec::new();
    let parse = |url: &Option<SecretUrl>| url.as_ref().and_then(|u| u.parse().ok());
    if let Some(url) = parse(&config.sessions.url)
        && url.password().is_none()
    {
        warnings.push(
            "sessions.url carries no password: any process that reaches this Redis, runners \
             included, can read and rewrite run sessions; set `requirepass` and put the \
             password in the URL (SECURITY.md)"
                .to_owned(),
        );
    }
    if let Some(url) = parse(&config.bus.url)
        && matches!(url.username(), "" | "guest")
    {
        warnings.push(
            "bus.url uses RabbitMQ's default `guest` user: create a user of the deployment's \
             own with a password (SECURITY.md)"
                .to_owned(),
        );
    }
    warnings
}

/// A role running alone must reach the other roles: the in-process bus and session store
/// only connect roles inside one process, so a lone gateway on them would accept events
/// that no orchestrator ever sees.
fn require_shared_backends(config: &SwitchboardConfig, roles: Roles) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    if config.bus.kind == BusKind::Memory {
        missing.push("bus.kind = amqp and bus.url (SWITCHBOARD__BUS__KIND=amqp, SWITCHBOARD__BUS__URL=amqp://…)");
    }
    if config.sessions.kind == SessionsKind::Memory {
        missing.push("sessions.kind = redis and sessions.url (SWITCHBOARD__SESSIONS__KIND=redis, SWITCHBOARD__SESSIONS__URL=redis://…)");
    }
    anyhow::ensure!(
        missing.is_empty(),
        "`switchboard {}` runs one role and shares its bus and session store with the other roles' processes; \
         the in-process ones cannot be shared. Set {}; or run every role in one process with `switchboard dev`",
        roles.names(),
        missing.join(" and ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use sb_common::config::ConfigLoader;

    #[test]
    fn backends_without_credentials_are_named() {
        let load = |redis: &str, amqp: &str| {
            ConfigLoader::new()
                .without_file()
                .set("sessions.url", redis)
                .set("bus.url", amqp)
                .load()
                .unwrap()
        };
        let open =
            unauthenticated_backends(&load("redis://127.0.0.1:6379", "amqp://guest:guest@h/%2f"));
        assert_eq!(open.len(), 2, "{open:?}");
        assert!(open[0].starts_with("sessions.url") && open[1].starts_with("bus.url"));
        let closed = unauthenticated_backends(&load(
            "redis://:pw@127.0.0.1:6379",
            "amqp://switchboard:pw@h/%2f",
        ));
        assert!(closed.is_empty(), "{closed:?}");
    }

    #[test]
    fn role_commands_refuse_the_in_process_backends() {
        let embedded = ConfigLoader::new().without_file().load().unwrap();
        let err = require_shared_backends(&embedded, Roles::GATEWAY).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("switchboard gateway"), "{msg}");
        assert!(msg.contains("bus.kind = amqp"), "{msg}");
        assert!(msg.contains("sessions.kind = redis"), "{msg}");
        assert!(msg.contains("switchboard dev"), "{msg}");

        let half = ConfigLoader::new()
            .without_file()
            .set("bus.kind", "amqp")
            .set("bus.url", "amqp://guest:guest@127.0.0.1:5672/%2f")
            .load()
            .unwrap();
        let msg = require_shared_backends(&half, Roles::WORKER)
            .unwrap_err()
            .to_string();
        assert!(!msg.contains("bus.kind"), "{msg}");
        assert!(msg.contains("sessions.kind = redis"), "{msg}");

        let shared = ConfigLoader::new()
            .without_file()
            .set("bus.kind", "amqp")
            .set("bus.url", "amqp://guest:guest@127.0.0.1:5672/%2f")
            .set("sessions.kind", "redis")
            .set("sessions.url", "redis://127.0.0.1:6379")
            .load()
            .unwrap();
        require_shared_backends(&shared, Roles::ORCHESTRATOR).unwrap();
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
