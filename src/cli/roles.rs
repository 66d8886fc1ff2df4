//! The long-running role commands: `dev`, `gateway`, `orchestrator`, `worker`.
//!
//! Each one loads and validates the configuration (its flags are the last override layer),
//! installs logging, then runs the role(s) with [`switchboard::embedded`] until ctrl-c /
//! SIGTERM, and drains in pipeline order (a second ctrl-c exits at once).
//!
//! - `dev`: every role in one process on the in-process bus and session store, SQLite under
//!   the data directory (`./.switchboard`), which it bootstraps: workspace `default`, an API
//!   key in `<data-dir>/api-key` (printed once), and the default agent: the local agent on
//!   the model of `--model-url`/`--model` (`[dev]`), or the echo runner without one.
//! - `gateway`, `orchestrator`, `worker`: one role on the shared backends (RabbitMQ, Redis);
//!   they refuse the in-process ones, which cannot connect separate processes.
//! - `runner` (hidden): a runner built into the binary, started by the worker.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use sb_common::config::{BusKind, SecretUrl, SessionsKind, SwitchboardConfig};
use sb_common::shutdown::Shutdown;
use sb_worker::WorkerOptions;
use sb_worker::plugins::CommandLookup;
use switchboard::builtin::{ECHO_RUNNER_ID, LOCAL_AGENT_RUNNER_ID};
use switchboard::default_agent::{Change, DEFAULT_MODEL_NAME, DefaultAgentReport};
use switchboard::embedded::{
    self, API_KEY_FILE, Bootstrap, DEFAULT_AGENT_NAME, Embedded, EmbeddedOptions, Roles, StopReport,
};

use super::db::{sqlite_file, sqlite_url_for_file, with_sqlite_create_mode};
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
    /// Make this environment variable available to models and tools as a secret (added to
    /// secrets.allow), e.g. `OPENAI_API_KEY`; repeat for several. The first one is also the
    /// API key of the `--model-url` model (dev.model_key_env). Never a `SWITCHBOARD*`
    /// variable.
    #[arg(long = "model-key-env", value_name = "VAR")]
    pub model_key_env: Vec<String>,
    /// OpenAI-compatible base URL of a model for the default agent, e.g.
    /// `http://127.0.0.1:11434/v1` (Ollama); with `--model`, the default agent is the local
    /// agent on that model instead of the echo runner (dev.model_url).
    #[arg(long, value_name = "URL", requires = "model")]
    pub model_url: Option<String>,
    /// The model's name at that server, e.g. `llama3.2` (dev.model).
    #[arg(long, value_name = "NAME", requires = "model_url")]
    pub model: Option<String>,
    /// The model's context window in tokens [default: 8192 assumed by the local agent]
    /// (dev.model_context_window).
    #[arg(long, value_name = "TOKENS")]
    pub model_context_window: Option<u32>,
}

impl DevArgs {
    /// What `dev` adds to the loaded configuration: loopback in `egress.allow` (a local
    /// Ollama or vLLM is the common model server on a developer's machine) and the
    /// `--model-key-env` variables in `secrets.allow`. Added, not set, so entries of the file
    /// or the environment are kept. Returns a line for each addition, for the banner.
    pub fn widen(&self, config: &mut SwitchboardConfig) -> anyhow::Result<Vec<String>> {
        let mut said = Vec::new();
        for net in sb_common::egress::LOOPBACK_ALLOW {
            if !config.egress.allow.iter().any(|e| e == net) {
                config.egress.allow.push(net.to_owned());
            }
        }
        said.push(format!(
            "egress    models and tools may reach loopback ({}); link-local and metadata \
             addresses stay unreachable",
            sb_common::egress::LOOPBACK_ALLOW.join(", ")
        ));
        for name in &self.model_key_env {
            sb_common::secrets::check_allowable(name)
                .map_err(|e| anyhow::anyhow!("--model-key-env: {e}"))?;
            if !config.secrets.allow.contains(name) {
                config.secrets.allow.push(name.clone());
            }
        }
        // The dev model's key, however it was configured (flag, `[dev]`, environment):
        // registering a model whose key the workers may not read would fail at start.
        if let Some(name) = config.dev.model_key_env.clone()
            && !config.secrets.allow.contains(&name)
        {
            config.secrets.allow.push(name);
        }
        if !config.secrets.allow.is_empty() {
            said.push(format!(
                "secrets   models and tools may reference {}",
                config.secrets.allow.join(", ")
            ));
        }
        Ok(said)
    }

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
        o.set_opt("dev.model_url", self.model_url.as_deref());
        o.set_opt("dev.model", self.model.as_deref());
        o.set_opt("dev.model_key_env", self.model_key_env.first());
        o.set_opt("dev.model_context_window", self.model_context_window);
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

fn display_paths(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| Path::display(p).to_string()).collect()
}

/// The data directory of `dev` when `--data-dir` is not given (where `switchboard send`
/// looks for the API key by default).
pub const DEFAULT_DATA_DIR: &str = ".switchboard";
/// Directory under the data directory that holds the generated plugin of the built-in echo
/// runner (see [`switchboard::builtin`]).
pub const BUILTIN_RUNNERS_DIR: &str = "builtin-runners";

/// Runs gateway, orchestrator and worker in this process.
pub async fn dev(args: DevArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.config.load_and_init_logging(args.overrides()?)?;
    let widened = args.widen(&mut config)?;
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("cannot create the data directory {}", data_dir.display()))?;
    prepare_sqlite(&mut config)?;
    let builtin = ensure_builtin_runners(&mut config, &data_dir)?;

    let shutdown = Shutdown::new();
    shutdown.listen_for_signals()?;
    let options = EmbeddedOptions {
        roles: Roles::ALL,
        bootstrap: Some(Bootstrap::new(&data_dir)),
        worker: WorkerOptions::default(),
    };
    let embedded = embedded::start_with(config, options, shutdown.clone())
        .await
        .context("cannot start")?;
    print_dev_banner(&embedded, &data_dir, &builtin, &widened);
    exit_on_second_signal(&shutdown);
    Ok(exit_code(&embedded.wait().await))
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

/// `switchboard runner <NAME>` (hidden): serves a runner built into this binary on
/// stdin/stdout. The worker starts it; nothing else may be written to stdout.
#[derive(Debug, Clone, Args)]
pub struct RunnerArgs {
    /// The built-in runner.
    #[arg(value_enum)]
    pub name: BuiltinRunner,
}

/// Runners built into the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BuiltinRunner {
    /// The echo runner (`plugin:switchboard/echo/default`).
    Echo,
    /// The local agent (`plugin:switchboard/local-agent/default`).
    LocalAgent,
}

/// Serves a built-in runner until the host ends it.
pub async fn runner(args: RunnerArgs) -> anyhow::Result<ExitCode> {
    let serve = match args.name {
        BuiltinRunner::Echo => switchboard::builtin::serve_echo,
        BuiltinRunner::LocalAgent => switchboard::builtin::serve_local_agent,
    };
    tokio::task::spawn_blocking(serve)
        .await
        .context("the runner thread failed")?
        .context("runner i/o")?;
    Ok(ExitCode::SUCCESS)
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

/// For a SQLite file database: creates its directory and lets the connection create the file.
fn prepare_sqlite(config: &mut SwitchboardConfig) -> anyhow::Result<()> {
    let url = config.database.url.expose().to_owned();
    if let Some(file) = sqlite_file(&url) {
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        config.database.url = SecretUrl::new(with_sqlite_create_mode(&url));
    }
    Ok(())
}

/// Makes sure the default agent's runners can be hosted: for the echo runner and the local
/// agent, when no configured (or bundled) plugin directory yields a runnable one (its
/// standalone binary was not built, e.g. after `cargo run -- dev`), registers the copy built
/// into this binary. Returns the runner ids that use the built-in copy.
fn ensure_builtin_runners(
    config: &mut SwitchboardConfig,
    data_dir: &Path,
) -> anyhow::Result<Vec<&'static str>> {
    let mut dirs = config.worker.runners_dirs.clone();
    dirs.extend(sb_worker::plugins::bundled_runners_dir(None));
    let exe = std::env::current_exe().context("cannot locate the switchboard executable")?;
    let (root, used) = builtin_fallbacks(&dirs, &CommandLookup::from_env(), data_dir, &exe)?;
    if let Some(plugins) = root {
        tracing::info!(
            plugins = %plugins.display(),
            runners = %used.join(", "),
            "runner binaries not found (build them with `cargo build --workspace --bins`); using the copies built into switchboard"
        );
        config.worker.runners_dirs.push(plugins);
    }
    Ok(used)
}

/// The plugins directory of the built-in runners (written under `data_dir`) that `dirs` do
/// not yield a loadable copy of, and their ids; `(None, [])` when they yield both.
fn builtin_fallbacks(
    dirs: &[PathBuf],
    lookup: &CommandLookup,
    data_dir: &Path,
    exe: &Path,
) -> anyhow::Result<(Option<PathBuf>, Vec<&'static str>)> {
    let root = data_dir.join(BUILTIN_RUNNERS_DIR);
    let mut used = Vec::new();
    type Write = fn(&Path, &Path) -> std::io::Result<PathBuf>;
    let builtins: [(&'static str, Write); 2] = [
        (ECHO_RUNNER_ID, switchboard::builtin::write_echo_plugin),
        (
            LOCAL_AGENT_RUNNER_ID,
            switchboard::builtin::write_local_agent_plugin,
        ),
    ];
    for (runner_id, write) in builtins {
        if switchboard::builtin::runner_loads(dirs, runner_id, lookup) {
            continue;
        }
        write(&root, exe).with_context(|| format!("cannot write {}", root.display()))?;
        used.push(runner_id);
    }
    Ok(((!used.is_empty()).then_some(root), used))
}

/// The startup summary of `dev`, on stdout.
fn print_dev_banner(
    embedded: &Embedded,
    data_dir: &Path,
    builtin: &[&'static str],
    widened: &[String],
) {
    let addr = embedded
        .http_addr()
        .unwrap_or_else(|| embedded.config().gateway.http_addr);
    // A wildcard bind is reachable on loopback; that is what a local client should use.
    let client_addr = if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    };
    let url = format!("http://{client_addr}");
    let mut out = String::new();
    out.push_str("Switchboard is running: gateway, orchestrator and worker in one process.\n\n");
    out.push_str(&format!("  API       http://{addr}\n"));
    out.push_str(&format!(
        "  data      {} (ledger: {})\n",
        data_dir.display(),
        embedded.config().database.url
    ));
    for line in widened {
        out.push_str(&format!("  {line}\n"));
    }
    if let Some(bootstrap) = embedded.bootstrap() {
        if bootstrap.api_key_created {
            out.push_str(&format!(
                "  API key   {}  (shown once; saved in {})\n",
                bootstrap.api_key,
                bootstrap.api_key_file.display()
            ));
        } else {
            out.push_str(&format!(
                "  API key   in {}\n",
                bootstrap.api_key_file.display()
            ));
        }
        if let Some(agent) = &bootstrap.agent {
            out.push_str(&agent_lines(agent));
        }
    }
    let runners: Vec<String> = embedded
        .runners()
        .iter()
        .map(|r| {
            if builtin.contains(&r.to_string().as_str()) {
                format!("{r} (built in)")
            } else {
                r.to_string()
            }
        })
        .collect();
    out.push_str(&format!(
        "  runners   {}\n",
        if runners.is_empty() {
            "none found (see --runners-dir)".to_owned()
        } else {
            runners.join(", ")
        }
    ));
    let mut send = String::from("switchboard send");
    if url != super::client::DEFAULT_GATEWAY_URL {
        send.push_str(&format!(" --url {url}"));
    }
    let default_key_file = Path::new(DEFAULT_DATA_DIR).join(API_KEY_FILE);
    if let Some(bootstrap) = embedded.bootstrap() {
        if !same_file(&bootstrap.api_key_file, &default_key_file) {
            send.push_str(&format!(
                " --api-key-file {}",
                bootstrap.api_key_file.display()
            ));
        }
    }
    out.push_str(&format!(
        "\nSend a message from another terminal:\n  {send} \"hello\"\nStop with Ctrl-C (in-flight runs finish first).\n"
    ));
    print!("{out}");
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// The banner lines about the default agent and the dev model.
fn agent_lines(agent: &DefaultAgentReport) -> String {
    let mut out = String::new();
    let runner = agent.runner_id.as_deref().unwrap_or_default();
    match (agent.agent_id, agent.change) {
        (Some(id), change) if change != Change::NotManaged => {
            let state = match change {
                Change::Created => " (created)",
                Change::Updated => " (updated)",
                _ => "",
            };
            out.push_str(&format!(
                "  agent     {DEFAULT_AGENT_NAME} ({id}){state} answers message.received with {runner}\n"
            ));
        }
        _ => out.push_str(&format!(
            "  agent     the workspace's own agents answer (its `{DEFAULT_AGENT_NAME}` agent was \
             replaced or removed, so switchboard dev leaves it alone)\n"
        )),
    }
    match &agent.model {
        Some(model) => out.push_str(&format!(
            "  model     {} at {} (registered as `{DEFAULT_MODEL_NAME}`, {})\n",
            model.model, model.base_url, model.model_id
        )),
        None => out.push_str(
            "  model     none: the default agent echoes. For a real model: \
             --model-url URL --model NAME [--model-key-env VAR]\n",
        ),
    }
    out
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::path::absolute(a), std::path::absolute(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// A second ctrl-c during the drain exits at once (runner processes see their stdin close
/// and stop on their own).
fn exit_on_second_signal(shutdown: &Shutdown) {
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted again: exiting without finishing the drain");
            std::process::exit(130);
        }
    });
}

/// Success unless a role failed on its own.
fn exit_code(report: &StopReport) -> ExitCode {
    match &report.failure {
        Some(failure) => {
            eprintln!("error: {failure}");
            ExitCode::FAILURE
        }
        None => ExitCode::SUCCESS,
    }
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
    fn dev_allows_loopback_and_the_named_model_key_and_keeps_configured_entries() {
        let mut config = ConfigLoader::new()
            .without_file()
            .env([
                ("SWITCHBOARD__EGRESS__ALLOW", "10.1.0.0/16"),
                ("SWITCHBOARD__SECRETS__ALLOW", "TOOL_TOKEN"),
            ])
            .load()
            .unwrap();
        let said = dev_args(&["--model-key-env", "OPENAI_API_KEY"])
            .widen(&mut config)
            .unwrap();
        assert_eq!(
            config.egress.allow,
            ["10.1.0.0/16", "127.0.0.0/8", "::1/128"]
        );
        assert_eq!(config.secrets.allow, ["TOOL_TOKEN", "OPENAI_API_KEY"]);
        assert!(said.iter().any(|l| l.contains("loopback")), "{said:?}");
        assert!(
            said.iter().any(|l| l.contains("OPENAI_API_KEY")),
            "{said:?}"
        );
        let err = dev_args(&["--model-key-env", "SWITCHBOARD__DATABASE__URL"])
            .widen(&mut config)
            .unwrap_err();
        assert!(
            err.to_string().contains("host's own configuration"),
            "{err}"
        );
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
    fn sqlite_databases_get_their_directory_and_create_mode() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nested").join("ledger.db");
        let mut config = ConfigLoader::new()
            .without_file()
            .set("database.url", format!("sqlite://{}", file.display()))
            .load()
            .unwrap();
        prepare_sqlite(&mut config).unwrap();
        assert!(file.parent().unwrap().is_dir());
        assert!(config.database.url.expose().ends_with("?mode=rwc"));

        let mut config = ConfigLoader::new()
            .without_file()
            .set("database.url", "postgres://postgres@127.0.0.1:5432/test")
            .load()
            .unwrap();
        prepare_sqlite(&mut config).unwrap();
        assert_eq!(
            config.database.url.expose(),
            "postgres://postgres@127.0.0.1:5432/test"
        );
    }

    #[test]
    fn the_built_in_runners_are_only_fallbacks() {
        let data = tempfile::tempdir().unwrap();
        let empty = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let lookup = CommandLookup::default();

        // Nothing provides the runners: the built-in copies are written and load.
        let (plugins, used) =
            builtin_fallbacks(&[empty.path().to_path_buf()], &lookup, data.path(), &exe).unwrap();
        let plugins = plugins.expect("a fallback");
        assert_eq!(used, [ECHO_RUNNER_ID, LOCAL_AGENT_RUNNER_ID]);
        assert!(plugins.starts_with(data.path()));
        for runner in used {
            assert!(switchboard::builtin::runner_loads(
                std::slice::from_ref(&plugins),
                runner,
                &lookup
            ));
        }

        // A directory that provides them (here: those same plugins) means no fallback.
        let other = tempfile::tempdir().unwrap();
        assert_eq!(
            builtin_fallbacks(std::slice::from_ref(&plugins), &lookup, other.path(), &exe).unwrap(),
            (None, Vec::new())
        );
        assert!(!other.path().join(BUILTIN_RUNNERS_DIR).exists());

        // Only the echo runner provided: only the local agent is built in.
        let echo_only = tempfile::tempdir().unwrap();
        switchboard::builtin::write_echo_plugin(echo_only.path(), &exe).unwrap();
        let (_, used) = builtin_fallbacks(
            &[echo_only.path().to_path_buf()],
            &lookup,
            other.path(),
            &exe,
        )
        .unwrap();
        assert_eq!(used, [LOCAL_AGENT_RUNNER_ID]);
    }

    #[test]
    fn dev_model_flags_map_onto_the_dev_section() {
        let args = dev_args(&[
            "--model-url",
            "http://127.0.0.1:11434/v1",
            "--model",
            "llama3.2",
            "--model-key-env",
            "OLLAMA_KEY",
            "--model-key-env",
            "TOOL_TOKEN",
            "--model-context-window",
            "32768",
        ]);
        let mut config = ConfigLoader::new()
            .without_file()
            .overrides(args.overrides().unwrap().0)
            .load()
            .unwrap();
        let model = config.dev.default_model().expect("a dev model");
        assert_eq!(model.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(model.model, "llama3.2");
        assert_eq!(
            model.api_key_env.as_deref(),
            Some("OLLAMA_KEY"),
            "the first key"
        );
        assert_eq!(model.context_window.map(|w| w.get()), Some(32_768));
        args.widen(&mut config).unwrap();
        assert_eq!(config.secrets.allow, ["OLLAMA_KEY", "TOOL_TOKEN"]);

        // Without the flags, nothing is set: the default agent stays echo.
        let config = ConfigLoader::new()
            .without_file()
            .overrides(dev_args(&[]).overrides().unwrap().0)
            .load()
            .unwrap();
        assert_eq!(config.dev.default_model(), None);
        // One without the other is refused when parsing the command line.
        for half in [&["--model", "m"][..], &["--model-url", "http://h/v1"][..]] {
            let mut argv = vec!["switchboard", "dev"];
            argv.extend_from_slice(half);
            assert!(Cli::try_parse_from(&argv).is_err(), "{half:?}");
        }
    }

    #[test]
    fn a_dev_model_key_from_the_file_is_allowed_as_a_secret() {
        let mut config = ConfigLoader::new()
            .without_file()
            .set("dev.model_url", "https://api.openai.com/v1")
            .set("dev.model", "gpt-4o-mini")
            .set("dev.model_key_env", "OPENAI_API_KEY")
            .load()
            .unwrap();
        let said = dev_args(&[]).widen(&mut config).unwrap();
        assert_eq!(config.secrets.allow, ["OPENAI_API_KEY"]);
        assert!(
            said.iter().any(|l| l.contains("OPENAI_API_KEY")),
            "{said:?}"
        );
    }

    #[test]
    fn the_banner_says_which_agent_answers_and_on_what_model() {
        use switchboard::default_agent::ModelReport;
        let id = sb_protocol::ids::AgentId::new();
        let echo = agent_lines(&DefaultAgentReport {
            agent_id: Some(id),
            runner_id: Some(ECHO_RUNNER_ID.into()),
            change: Change::Created,
            model: None,
        });
        assert!(
            echo.contains(&format!(
                "default ({id}) (created) answers message.received with {ECHO_RUNNER_ID}"
            )),
            "{echo}"
        );
        assert!(
            echo.contains("model     none: the default agent echoes"),
            "{echo}"
        );
        assert!(echo.contains("--model-url URL --model NAME"), "{echo}");
        let local = agent_lines(&DefaultAgentReport {
            agent_id: Some(id),
            runner_id: Some(LOCAL_AGENT_RUNNER_ID.into()),
            change: Change::Unchanged,
            model: Some(ModelReport {
                model_id: uuid::Uuid::nil(),
                model: "llama3.2".into(),
                base_url: "http://127.0.0.1:11434/v1".into(),
            }),
        });
        assert!(
            local.contains(&format!(
                "answers message.received with {LOCAL_AGENT_RUNNER_ID}"
            )),
            "{local}"
        );
        assert!(
            local.contains("model     llama3.2 at http://127.0.0.1:11434/v1"),
            "{local}"
        );
        let theirs = agent_lines(&DefaultAgentReport {
            agent_id: None,
            runner_id: None,
            change: Change::NotManaged,
            model: None,
        });
        assert!(
            theirs.contains("the workspace's own agents answer"),
            "{theirs}"
        );
    }

    #[test]
    fn the_hidden_runner_command_parses() {
        let cli = Cli::try_parse_from(["switchboard", "runner", "echo"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Runner(RunnerArgs {
                name: BuiltinRunner::Echo
            })
        ));
        let cli = Cli::try_parse_from(["switchboard", "runner", "local-agent"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Runner(RunnerArgs {
                name: BuiltinRunner::LocalAgent
            })
        ));
        assert!(Cli::try_parse_from(["switchboard", "runner", "nope"]).is_err());
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
