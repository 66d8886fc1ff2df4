//! `switchboard dev`: every role in one process on the in-process bus and session store,
//! SQLite under the data directory (`./.switchboard`), which it bootstraps: workspace
//! `default`, an API key in `<data-dir>/api-key` (printed once), and the default agent: the
//! local agent on the model of `--model-url`/`--model` (`[dev]`), or the echo runner
//! without one. When the standalone runner binaries are missing (`cargo run -- dev`), the
//! copies built into the binary stand in ([`crate::builtin`]). It runs until ctrl-c /
//! SIGTERM and drains in pipeline order (a second ctrl-c exits at once).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use sb_common::config::{SecretUrl, SwitchboardConfig};
use sb_common::shutdown::Shutdown;
use sb_worker::WorkerOptions;
use sb_worker::plugins::CommandLookup;

use crate::builtin::{ECHO_RUNNER_ID, LOCAL_AGENT_RUNNER_ID};
use crate::cli::config::{ConfigArgs, Overrides, display_paths};
use crate::cli::db::{sqlite_file, sqlite_url_for_file, with_sqlite_create_mode};
use crate::cli::lifecycle::{exit_code, exit_on_second_signal};
use crate::default_agent::{Change, DEFAULT_MODEL_NAME, DefaultAgentReport};
use crate::embedded::{
    self, API_KEY_FILE, Bootstrap, DEFAULT_AGENT_NAME, Embedded, EmbeddedOptions, Roles,
};

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

/// The data directory of `dev` when `--data-dir` is not given (where `switchboard send`
/// looks for the API key by default).
pub const DEFAULT_DATA_DIR: &str = ".switchboard";
/// Directory under the data directory that holds the generated plugin of the built-in echo
/// runner (see [`crate::builtin`]).
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
        (ECHO_RUNNER_ID, crate::builtin::write_echo_plugin),
        (
            LOCAL_AGENT_RUNNER_ID,
            crate::builtin::write_local_agent_plugin,
        ),
    ];
    for (runner_id, write) in builtins {
        if crate::builtin::runner_loads(dirs, runner_id, lookup) {
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
    if url != crate::cli::gateway::DEFAULT_GATEWAY_URL {
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
            assert!(crate::builtin::runner_loads(
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
        crate::builtin::write_echo_plugin(echo_only.path(), &exe).unwrap();
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
        use crate::default_agent::ModelReport;
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
    fn dev_rejects_a_bad_http_addr_at_parse_time() {
        let mut argv = vec!["switchboard", "dev", "--http-addr", "nowhere"];
        assert!(Cli::try_parse_from(&argv).is_err());
        argv.truncate(2);
        assert!(Cli::try_parse_from(&argv).is_ok());
    }
}
