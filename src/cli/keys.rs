//! `switchboard keys create|list|revoke`: API keys, through a running gateway or directly on
//! the ledger database.
//!
//! | command | default | other form |
//! | --- | --- | --- |
//! | `keys create` | the database (`database.url`, or `--database-url` / `--data-dir`) | `--url`: `POST /v1/keys` with an admin key |
//! | `keys list`, `keys revoke ID` | the gateway (`--url` / `SWITCHBOARD_URL`, an admin key) | `--database-url` / `--data-dir` |
//!
//! `create` works on the database by default because it is how the first key of a
//! deployment is made (nothing can call the gateway before a key exists) and what scripts
//! use before any gateway runs (`scripts/cluster`); it prints only the key on stdout, so
//! `KEY=$(switchboard keys create)` works. Its `--role` defaults to `admin` there, the power
//! every key had before roles existed, and to `client` through the gateway, where one key
//! makes another and the least power is the safe default.
//!
//! `revoke` through the gateway is effective on the next request on every gateway (the
//! gateway announces it, see `sb_gateway::auth`). On the database, the CLI announces it
//! itself when the configuration names a shared session store (`sessions.kind = "redis"`);
//! otherwise (a `switchboard dev` data directory: its session store lives in the dev process)
//! it says that a running gateway may accept the key from its cache for up to
//! [`KEY_CACHE_MAX_AGE`].

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use reqwest::Method;
use sb_common::config::{SessionsKind, SwitchboardConfig};
use sb_gateway::auth::{KEY_CACHE_MAX_AGE, announce_revocation};
use sb_protocol::ids::WorkspaceId;
use sb_store::{ApiKeyRecord, ApiKeyRole, NewApiKey, Tenancy as _};
use serde_json::{Value, json};

use crate::cli::config::{ConfigArgs, Overrides};
use crate::cli::db;
use crate::cli::dev::DEV_DATABASE_FILE;
use crate::cli::gateway::GatewayClientArgs;
use crate::client::GatewayClient;

/// How long the CLI waits for the session store when announcing a revocation.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// is stored). Works on the database unless --url is given.
    Create(CreateKeyArgs),
    /// List the workspace's keys (never their secrets). Through the gateway unless
    /// --database-url or --data-dir is given.
    List(ListKeysArgs),
    /// Revoke a key: it is refused from the next request on. Through the gateway unless
    /// --database-url or --data-dir is given.
    Revoke(RevokeKeyArgs),
}

/// A key role on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    /// Events, runs, turns, sessions, conversations, streams; lists agents.
    Client,
    /// Also agents, models, tools, knowledge bases, schedules and keys.
    Admin,
}

impl From<RoleArg> for ApiKeyRole {
    fn from(role: RoleArg) -> Self {
        match role {
            RoleArg::Client => Self::Client,
            RoleArg::Admin => Self::Admin,
        }
    }
}

/// The database form's flags, shared by the subcommands.
#[derive(Debug, Clone, Default, Args)]
pub struct DatabaseArgs {
    /// Work directly on this ledger database (database.url).
    #[arg(long, value_name = "URL", conflicts_with = "data_dir")]
    pub database_url: Option<String>,
    /// Work directly on the ledger of this `switchboard dev` data directory
    /// (`<DIR>/switchboard.db`).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Workspace of the keys, on the database [default: default]. Through the gateway it is
    /// the admin key's workspace.
    #[arg(long, value_name = "WORKSPACE")]
    pub workspace: Option<String>,
}

impl DatabaseArgs {
    /// Whether the database form was asked for by a flag.
    fn selected(&self) -> bool {
        self.database_url.is_some() || self.data_dir.is_some()
    }

    /// The configuration overrides of the database form.
    fn overrides(&self) -> anyhow::Result<Overrides> {
        let mut o = Overrides::default();
        o.set_opt("database.url", self.database_url.as_deref());
        if let Some(dir) = &self.data_dir {
            o.set(
                "database.url",
                db::sqlite_url_for_file(&dir.join(DEV_DATABASE_FILE))?,
            );
        }
        Ok(o)
    }

    fn workspace(&self) -> anyhow::Result<WorkspaceId> {
        let text = self.workspace.as_deref().unwrap_or("default");
        text.parse()
            .with_context(|| format!("invalid --workspace `{text}`"))
    }

    /// Refuses `--workspace` where it would be ignored.
    fn refuse_workspace_through_gateway(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.workspace.is_none(),
            "--workspace applies to the database form (--database-url or --data-dir); through \
             the gateway the workspace is the admin key's"
        );
        Ok(())
    }
}

/// `switchboard keys create`.
#[derive(Debug, Clone, Args)]
pub struct CreateKeyArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Label stored with the key, to tell keys apart when listing them.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// What the key may do [default: admin on the database, client through the gateway].
    #[arg(long, value_enum, value_name = "ROLE")]
    pub role: Option<RoleArg>,
    /// Create the key through this gateway (`POST /v1/keys`, in the workspace of the admin
    /// key) instead of on the database.
    #[arg(long, value_name = "URL", conflicts_with_all = ["database_url", "data_dir"])]
    pub url: Option<String>,
    /// Admin API key for --url. Prefer --api-key-file or the environment: command lines are
    /// visible to other users of the machine.
    #[arg(
        long,
        env = "SWITCHBOARD_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,
    /// File containing the admin API key for --url. Without a key, ./.switchboard/api-key
    /// (kept by `switchboard dev`) is read when it exists.
    #[arg(long, value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
}

impl CreateKeyArgs {
    /// The configuration overrides of `keys create`.
    pub fn overrides(&self) -> anyhow::Result<Overrides> {
        self.database.overrides()
    }

    /// The gateway flags, when --url was given.
    fn gateway(&self) -> Option<GatewayClientArgs> {
        self.url.as_ref().map(|url| GatewayClientArgs {
            url: url.clone(),
            api_key: self.api_key.clone(),
            api_key_file: self.api_key_file.clone(),
        })
    }
}

/// `switchboard keys list`.
#[derive(Debug, Clone, Args)]
pub struct ListKeysArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
    /// Print `{"items": [...]}` as JSON (the `GET /v1/keys` shape) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `switchboard keys revoke`.
#[derive(Debug, Clone, Args)]
pub struct RevokeKeyArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Id of the key (the `KEY_ID` column of `keys list`).
    #[arg(value_name = "KEY_ID")]
    pub key_id: uuid::Uuid,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// Runs a `keys` subcommand.
pub async fn run(args: KeysArgs) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    match args.command {
        KeysCommand::Create(args) => {
            let config = args.config.load_and_init_logging(args.overrides()?)?;
            match args.gateway() {
                Some(gateway) => {
                    args.database.refuse_workspace_through_gateway()?;
                    let client = gateway_client(&gateway)?;
                    create_through(&client, &args, &mut stdout).await?;
                }
                None => {
                    create(&config, &args, &mut stdout).await?;
                }
            }
        }
        KeysCommand::List(args) => {
            let config = args
                .config
                .load_and_init_logging(args.database.overrides()?)?;
            let items = if args.database.selected() {
                list(&config, &args.database).await?
            } else {
                args.database.refuse_workspace_through_gateway()?;
                list_through(&gateway_client(&args.gateway)?).await?
            };
            print_keys(&items, args.json, &mut stdout)?;
        }
        KeysCommand::Revoke(args) => {
            let config = args
                .config
                .load_and_init_logging(args.database.overrides()?)?;
            let message = if args.database.selected() {
                revoke(&config, &args.database, args.key_id).await?
            } else {
                args.database.refuse_workspace_through_gateway()?;
                revoke_through(&gateway_client(&args.gateway)?, args.key_id).await?
            };
            eprintln!("{message}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn gateway_client(gateway: &GatewayClientArgs) -> anyhow::Result<GatewayClient> {
    gateway.client()
}

/// Creates a key on the database and writes only its plaintext and a newline to `out`, so
/// that `KEY=$(switchboard keys create)` works; everything else goes to the logs (stderr).
pub async fn create(
    config: &SwitchboardConfig,
    args: &CreateKeyArgs,
    out: &mut impl Write,
) -> anyhow::Result<NewApiKey> {
    let workspace = args.database.workspace()?;
    let role = args.role.map_or(ApiKeyRole::Admin, ApiKeyRole::from);
    let store = db::connect(config, false).await?;
    db::ensure_migrated(&store).await?;
    let key = store
        .create_api_key(&workspace, args.name.as_deref(), role)
        .await
        .context("cannot create the API key")?;
    print_secret(out, &key.plaintext)?;
    tracing::info!(key_id = %key.record.id, prefix = %key.record.prefix, %role, workspace = %workspace, "API key created");
    Ok(key)
}

/// Creates a key through the gateway (`POST /v1/keys`) and writes only its plaintext and a
/// newline to `out`; the answer's other fields are returned.
pub async fn create_through(
    client: &GatewayClient,
    args: &CreateKeyArgs,
    out: &mut impl Write,
) -> anyhow::Result<Value> {
    let role = args.role.map_or(ApiKeyRole::Client, ApiKeyRole::from);
    let mut answer = client
        .json(
            Method::POST,
            "/v1/keys",
            Some(&json!({"name": args.name, "role": role})),
        )
        .await?;
    let key = answer
        .as_object_mut()
        .and_then(|o| o.remove("key"))
        .and_then(|k| k.as_str().map(str::to_owned))
        .context("the gateway's answer has no key")?;
    print_secret(out, &key)?;
    tracing::info!(key_id = %answer["key_id"], prefix = %answer["prefix"], %role, "API key created");
    Ok(answer)
}

fn print_secret(out: &mut impl Write, secret: &str) -> anyhow::Result<()> {
    writeln!(out, "{secret}").context("cannot write the key")?;
    out.flush().context("cannot write the key")
}

/// The workspace's keys from the database, in the `GET /v1/keys` item shape.
pub async fn list(
    config: &SwitchboardConfig,
    database: &DatabaseArgs,
) -> anyhow::Result<Vec<Value>> {
    let workspace = database.workspace()?;
    let store = db::connect(config, false).await?;
    db::ensure_migrated(&store).await?;
    let keys = store
        .list_api_keys(&workspace)
        .await
        .context("cannot list the API keys")?;
    Ok(keys.iter().map(key_item).collect())
}

/// The caller's workspace's keys through the gateway (`GET /v1/keys`).
pub async fn list_through(client: &GatewayClient) -> anyhow::Result<Vec<Value>> {
    let answer = client.json(Method::GET, "/v1/keys", None).await?;
    match answer.get("items") {
        Some(Value::Array(items)) => Ok(items.clone()),
        _ => anyhow::bail!("the gateway's answer has no `items` list"),
    }
}

/// A record as `GET /v1/keys` shows it.
fn key_item(record: &ApiKeyRecord) -> Value {
    let mut item = json!({
        "key_id": record.id,
        "name": record.name,
        "role": record.role,
        "prefix": record.prefix,
        "created_at": record.created_at.timestamp(),
    });
    if let Some(at) = record.revoked_at {
        item["revoked_at"] = json!(at.timestamp());
    }
    item
}

/// Writes `items` as JSON (`{"items": [...]}`) or as a table.
fn print_keys(items: &[Value], as_json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    if as_json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&json!({"items": items}))?
        )?;
        return Ok(out.flush()?);
    }
    writeln!(
        out,
        "{:<36}  {:<6}  {:<11}  {:<20}  {:<20}  NAME",
        "KEY_ID", "ROLE", "PREFIX", "CREATED", "REVOKED"
    )?;
    for item in items {
        let text = |field: &str| item[field].as_str().unwrap_or("").to_owned();
        let time = |field: &str| {
            item[field]
                .as_i64()
                .and_then(|secs| chrono::DateTime::from_timestamp(secs, 0))
                .map_or_else(
                    || "-".to_owned(),
                    |at| at.format("%Y-%m-%d %H:%M:%SZ").to_string(),
                )
        };
        let current = if item["current"].as_bool() == Some(true) {
            " (this key)"
        } else {
            ""
        };
        writeln!(
            out,
            "{:<36}  {:<6}  {:<11}  {:<20}  {:<20}  {}{current}",
            text("key_id"),
            text("role"),
            text("prefix"),
            time("created_at"),
            time("revoked_at"),
            text("name"),
        )?;
    }
    Ok(out.flush()?)
}

/// Revokes the workspace's key `key_id` on the database, then tells the gateways when the
/// configuration names a shared session store. The answer says which guarantee holds.
pub async fn revoke(
    config: &SwitchboardConfig,
    database: &DatabaseArgs,
    key_id: uuid::Uuid,
) -> anyhow::Result<String> {
    let workspace = database.workspace()?;
    let store = db::connect(config, false).await?;
    db::ensure_migrated(&store).await?;
    store
        .get_api_key(&workspace, key_id)
        .await
        .context("cannot read the API key")?
        .with_context(|| format!("workspace {workspace} has no API key {key_id}"))?;
    store
        .revoke(&workspace, key_id)
        .await
        .context("cannot revoke the API key")?;
    tracing::info!(%key_id, %workspace, "API key revoked in the database");
    let max_age = KEY_CACHE_MAX_AGE.as_secs();
    let message = match config.sessions.kind {
        SessionsKind::Redis => match announce(config).await {
            Ok(()) => {
                format!("revoked API key {key_id}: every gateway refuses it from its next request")
            }
            Err(error) => format!(
                "revoked API key {key_id} in the database, but the gateways could not be told \
                 ({error:#}): a gateway that cached the key accepts it for up to {max_age} s; \
                 run the command again to tell them"
            ),
        },
        SessionsKind::Memory => format!(
            "revoked API key {key_id} in the database. No shared session store is configured \
             (sessions.kind = \"memory\"), so a running gateway (`switchboard dev`) that cached \
             the key accepts it for up to {max_age} s; `switchboard keys revoke` through the \
             gateway (without --database-url/--data-dir) is effective at once"
        ),
    };
    Ok(message)
}

/// Announces a revocation on the configured shared session store.
async fn announce(config: &SwitchboardConfig) -> anyhow::Result<()> {
    tokio::time::timeout(ANNOUNCE_TIMEOUT, async {
        let sessions = crate::embedded::open_sessions(config)
            .await
            .context("cannot connect to the session store")?;
        announce_revocation(sessions.as_ref())
            .await
            .context("cannot write the revocation epoch")
    })
    .await
    .context("the session store did not answer in time")?
}

/// Revokes a key through the gateway (`DELETE /v1/keys/{id}`).
pub async fn revoke_through(client: &GatewayClient, key_id: uuid::Uuid) -> anyhow::Result<String> {
    client
        .json(Method::DELETE, &format!("/v1/keys/{key_id}"), None)
        .await?;
    Ok(format!(
        "revoked API key {key_id}: every gateway refuses it from its next request"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use sb_common::config::ConfigLoader;

    fn keys_command(argv: &[&str]) -> KeysCommand {
        let mut full = vec!["switchboard", "keys"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Keys(KeysArgs { command }) => command,
            other => panic!("{other:?}"),
        }
    }

    fn create_args(argv: &[&str]) -> CreateKeyArgs {
        let mut full = vec!["create"];
        full.extend_from_slice(argv);
        match keys_command(&full) {
            KeysCommand::Create(a) => a,
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
        let found = store.authenticate(printed.trim()).await.unwrap().unwrap();
        assert_eq!(found.workspace_id.as_str(), "team-a");
        assert_eq!(
            found.role,
            ApiKeyRole::Admin,
            "the database form makes admin keys"
        );
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
            store
                .authenticate(&key.plaintext)
                .await
                .unwrap()
                .map(|k| k.workspace_id),
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

    /// The documented forms parse as documented: `create` on the database unless `--url`,
    /// `list`/`revoke` through the gateway unless a database flag.
    #[test]
    fn the_documented_forms_select_their_target() {
        // README and scripts/cluster.
        let a = create_args(&["--workspace", "default", "--name", "scripts-cluster"]);
        assert!(a.gateway().is_none());
        assert_eq!(a.database.workspace.as_deref(), Some("default"));
        assert_eq!(a.role, None);
        let a = create_args(&["--role", "client", "--data-dir", "/tmp/x"]);
        assert_eq!(a.role, Some(RoleArg::Client));
        assert!(
            a.overrides().unwrap().get("database.url").is_some(),
            "--data-dir names the dev ledger"
        );
        let a = create_args(&["--url", "http://127.0.0.1:1", "--role", "admin"]);
        assert_eq!(a.gateway().unwrap().url, "http://127.0.0.1:1");
        assert!(
            Cli::try_parse_from([
                "switchboard",
                "keys",
                "create",
                "--url",
                "http://x",
                "--database-url",
                "sqlite::memory:"
            ])
            .is_err(),
            "one target at a time"
        );
        assert!(Cli::try_parse_from(["switchboard", "keys", "create", "--role", "root"]).is_err());

        let KeysCommand::List(l) = keys_command(&["list"]) else {
            panic!()
        };
        assert!(!l.database.selected());
        let KeysCommand::List(l) = keys_command(&["list", "--data-dir", "d", "--json"]) else {
            panic!()
        };
        assert!(l.database.selected() && l.json);
        let id = uuid::Uuid::now_v7().to_string();
        let KeysCommand::Revoke(r) = keys_command(&["revoke", &id, "--database-url", "sqlite:x"])
        else {
            panic!()
        };
        assert!(r.database.selected());
        assert_eq!(r.key_id.to_string(), id);
        assert!(Cli::try_parse_from(["switchboard", "keys", "revoke", "not-a-uuid"]).is_err());
    }

    /// `keys create|list|revoke` on a SQLite ledger: roles, the listing without secrets,
    /// revocation scoped to the workspace and what the answer says about the guarantee.
    #[tokio::test]
    async fn create_list_and_revoke_on_a_sqlite_database() {
        let dir = tempfile::tempdir().unwrap();
        let config = sqlite_config(dir.path());
        crate::cli::migrate::apply(&config).await.unwrap();
        let database = DatabaseArgs::default();

        let mut out = Vec::new();
        let admin = create(&config, &create_args(&["--name", "ops"]), &mut out)
            .await
            .unwrap();
        let client = create(
            &config,
            &create_args(&["--name", "app", "--role", "client"]),
            &mut Vec::new(),
        )
        .await
        .unwrap();
        let other = create(
            &config,
            &create_args(&["--workspace", "team-b"]),
            &mut Vec::new(),
        )
        .await
        .unwrap();
        assert_eq!(admin.record.role, ApiKeyRole::Admin);
        assert_eq!(client.record.role, ApiKeyRole::Client);

        let items = list(&config, &database).await.unwrap();
        assert_eq!(items.len(), 2, "only the workspace's keys: {items:?}");
        assert_eq!(items[0]["key_id"], admin.record.id.to_string());
        assert_eq!(items[0]["role"], "admin");
        assert_eq!(items[1]["name"], "app");
        assert_eq!(items[1]["role"], "client");
        let mut printed = Vec::new();
        print_keys(&items, false, &mut printed).unwrap();
        let table = String::from_utf8(printed).unwrap();
        assert!(table.starts_with("KEY_ID"), "{table}");
        assert!(table.contains(&client.record.prefix), "{table}");
        let mut printed = Vec::new();
        print_keys(&items, true, &mut printed).unwrap();
        let json_text = String::from_utf8(printed).unwrap();
        for secret in [&admin.plaintext, &client.plaintext] {
            assert!(!table.contains(secret.as_str()) && !json_text.contains(secret.as_str()));
        }
        let parsed: Value = serde_json::from_str(&json_text).unwrap();
        assert_eq!(parsed["items"].as_array().unwrap().len(), 2);

        // Another workspace's key is not found through this one.
        let err = revoke(&config, &database, other.record.id)
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("has no API key"), "{err:#}");

        let message = revoke(&config, &database, client.record.id).await.unwrap();
        assert!(message.contains("up to 60 s"), "{message}");
        let store = db::connect(&config, false).await.unwrap();
        assert!(
            store
                .authenticate(&client.plaintext)
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            store
                .authenticate(&admin.plaintext)
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            store
                .authenticate(&other.plaintext)
                .await
                .unwrap()
                .is_some()
        );
        let items = list(&config, &database).await.unwrap();
        assert!(items[1]["revoked_at"].is_i64(), "{items:?}");
        assert!(items[0].get("revoked_at").is_none());
        // Revoking again is harmless.
        revoke(&config, &database, client.record.id).await.unwrap();

        let team_b = DatabaseArgs {
            workspace: Some("team-b".into()),
            ..DatabaseArgs::default()
        };
        assert_eq!(list(&config, &team_b).await.unwrap().len(), 1);
    }

    /// Against a shared (Redis) session store, the database form tells the gateways itself.
    #[tokio::test]
    async fn a_database_revocation_is_announced_on_a_shared_session_store() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = format!("sbkeys-{}:", uuid::Uuid::new_v4().simple());
        let redis = std::env::var("SWITCHBOARD_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let config = ConfigLoader::new()
            .without_file()
            .set(
                "database.url",
                db::sqlite_url_for_file(&dir.path().join("ledger.db")).unwrap(),
            )
            .set("sessions.kind", "redis")
            .set("sessions.url", redis)
            .set("sessions.key_prefix", prefix)
            .load()
            .unwrap();
        crate::cli::migrate::apply(&config).await.unwrap();
        let key = create(&config, &create_args(&[]), &mut Vec::new())
            .await
            .unwrap();
        let sessions = crate::embedded::open_sessions(&config).await.unwrap();
        let before = sessions
            .get(sb_gateway::auth::REVOCATION_EPOCH_KEY)
            .await
            .unwrap();
        let message = revoke(&config, &DatabaseArgs::default(), key.record.id)
            .await
            .unwrap();
        assert!(message.contains("every gateway refuses it"), "{message}");
        let after = sessions
            .get(sb_gateway::auth::REVOCATION_EPOCH_KEY)
            .await
            .unwrap();
        assert!(
            after.is_some() && after != before,
            "a new epoch was written"
        );
    }
}
