//! `switchboard keys`: API key management against the ledger database.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use sb_common::config::SwitchboardConfig;
use sb_protocol::ids::WorkspaceId;
use sb_store::{NewApiKey, Tenancy as _};

use super::{ConfigArgs, Overrides, db};

/// `switchboard keys`.
#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// The `keys` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum KeysCommand {
    /// Create an API key and print it (only the key, on stdout; it is shown once, only its hash
    /// is stored).
    Create(CreateKeyArgs),
}

/// `switchboard keys create`.
#[derive(Debug, Clone, Args)]
pub struct CreateKeyArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Workspace the key grants access to (created if missing).
    #[arg(long, default_value = "default", value_name = "WORKSPACE")]
    pub workspace: String,
    /// Label stored with the key, to tell keys apart when listing them.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Ledger database (database.url).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl CreateKeyArgs {
    /// The configuration overrides of `keys create`.
    pub fn overrides(&self) -> Overrides {
        let mut o = Overrides::default();
        o.set_opt("database.url", self.database_url.as_deref());
        o
    }
}

/// Runs a `keys` subcommand.
pub async fn run(args: KeysArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        KeysCommand::Create(args) => {
            let config = args.config.load_and_init_logging(args.overrides())?;
            let mut stdout = std::io::stdout().lock();
            create(&config, &args, &mut stdout).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Creates a key and writes only its plaintext and a newline to `out`, so that
/// `KEY=$(switchboard keys create)` works; everything else goes to the logs (stderr).
pub async fn create(
    config: &SwitchboardConfig,
    args: &CreateKeyArgs,
    out: &mut impl Write,
) -> anyhow::Result<NewApiKey> {
    let workspace: WorkspaceId = args
        .workspace
        .parse()
        .with_context(|| format!("invalid --workspace `{}`", args.workspace))?;
    let store = db::connect(config, false).await?;
    db::ensure_migrated(&store).await?;
    let key = store
        .create_api_key(&workspace, args.name.as_deref())
        .await
        .context("cannot create the API key")?;
    writeln!(out, "{}", key.plaintext).context("cannot write the key")?;
    out.flush().context("cannot write the key")?;
    tracing::info!(key_id = %key.id, prefix = %key.prefix, workspace = %workspace, "API key created");
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use sb_common::config::ConfigLoader;

    fn create_args(argv: &[&str]) -> CreateKeyArgs {
        let mut full = vec!["switchboard", "keys", "create"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Keys(KeysArgs {
                command: KeysCommand::Create(a),
            }) => a,
            other => panic!("{other:?}"),
        }
    }

    fn sqlite_config(dir: &std::path::Path) -> SwitchboardConfig {
        let url = db::sqlite_url_for_file(&dir.join("ledger.db")).unwrap();
        ConfigLoader::new()
            .without_file()
            .set("database.url", url)
            .load()
            .unwrap()
    }

    #[tokio::test]
    async fn prints_only_a_key_that_authenticates_for_the_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let config = sqlite_config(dir.path());
        crate::cli::migrate::apply(&config).await.unwrap();

        let args = create_args(&["--workspace", "team-a", "--name", "ci"]);
        let mut out = Vec::new();
        let key = create(&config, &args, &mut out).await.unwrap();
        let printed = String::from_utf8(out).unwrap();
        assert_eq!(printed, format!("{}\n", key.plaintext));

        let store = db::connect(&config, false).await.unwrap();
        let workspace = store.authenticate(printed.trim()).await.unwrap();
        assert_eq!(workspace.map(|w| w.to_string()).as_deref(), Some("team-a"));
        let listed = store
            .list_api_keys(&"team-a".parse().unwrap())
            .await
            .unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name.as_deref(), Some("ci"));
    }

    #[tokio::test]
    async fn default_workspace_is_default() {
        let dir = tempfile::tempdir().unwrap();
        let config = sqlite_config(dir.path());
        crate::cli::migrate::apply(&config).await.unwrap();
        let mut out = Vec::new();
        let key = create(&config, &create_args(&[]), &mut out).await.unwrap();
        let store = db::connect(&config, false).await.unwrap();
        assert_eq!(
            store.authenticate(&key.plaintext).await.unwrap(),
            Some(WorkspaceId::default_workspace())
        );
    }

    #[tokio::test]
    async fn unmigrated_database_is_refused_with_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        let config = sqlite_config(dir.path());
        // Create the file without migrating it.
        drop(db::connect(&config, true).await.unwrap());
        let mut out = Vec::new();
        let err = create(&config, &create_args(&[]), &mut out)
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("run `switchboard migrate` first"),
            "{err:#}"
        );
        assert!(out.is_empty(), "nothing on stdout on failure");
    }

    #[tokio::test]
    async fn invalid_workspace_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let config = sqlite_config(dir.path());
        let mut out = Vec::new();
        let err = create(&config, &create_args(&["--workspace", ""]), &mut out)
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("invalid --workspace"),
            "{err:#}"
        );
    }
}
