//! `switchboard migrate`: applies pending migrations and exits.
//!
//! Safe to run concurrently with other `migrate` runs and with roles that migrate on start:
//! `sb_migrations::migrate` serialises them (advisory lock on Postgres, `BEGIN IMMEDIATE` on
//! SQLite) and applies everything pending in one transaction.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use sb_common::config::SwitchboardConfig;
use sb_migrations::{Migrator, MigratorTrait as _};

use crate::cli::config::{ConfigArgs, Overrides};

/// `switchboard migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Database to migrate (database.url). A SQLite file is created if missing.
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl MigrateArgs {
    /// The configuration overrides of `migrate`.
    pub fn overrides(&self) -> Overrides {
        let mut o = Overrides::default();
        o.set_opt("database.url", self.database_url.as_deref());
        o
    }
}

/// Runs `switchboard migrate`.
pub async fn run(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    let config = args.config.load_and_init_logging(args.overrides())?;
    let progress = crate::cli::output::spinner("applying migrations");
    let applied = apply(&config).await;
    progress.finish_and_clear();
    let applied = applied?;
    tracing::info!(applied, database = %config.database.url, "database is up to date");
    Ok(ExitCode::SUCCESS)
}

/// Connects (creating a SQLite file if needed) and applies every pending migration. Returns
/// how many were pending.
pub async fn apply(config: &SwitchboardConfig) -> anyhow::Result<usize> {
    let store = crate::cli::db::connect(config, true).await?;
    let pending = Migrator::get_pending_migrations_read_only(store.connection())
        .await
        .context("cannot read the migration state")?
        .len();
    store.migrate().await.context("migration failed")?;
    store
        .connection()
        .clone()
        .close()
        .await
        .context("cannot close the database")?;
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::{ConnectionTrait as _, Statement};

    #[tokio::test]
    async fn migrates_a_new_sqlite_file_in_a_new_directory_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nested").join("ledger.db");
        let url = format!("sqlite://{}", file.display());
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .set("database.url", url)
            .load()
            .unwrap();

        let first = apply(&config).await.unwrap();
        assert!(first > 0, "a new database has pending migrations");
        assert!(file.is_file());
        assert_eq!(
            apply(&config).await.unwrap(),
            0,
            "second run applies nothing"
        );

        let store = crate::cli::db::connect(&config, false).await.unwrap();
        let db = store.connection();
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT count(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'api_keys'",
            ))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.try_get::<i64>("", "n").unwrap(), 1);
    }

    #[tokio::test]
    async fn unreachable_database_is_a_clear_error() {
        let config = sb_common::config::ConfigLoader::new()
            .without_file()
            .set("database.url", "postgres://nobody:secret@127.0.0.1:1/none")
            .set("database.connect_timeout", "2s")
            .load()
            .unwrap();
        let err = apply(&config).await.unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("cannot connect to postgres://nobody:****@127.0.0.1:1/none"),
            "{msg}"
        );
        assert!(!msg.contains("secret"), "{msg}");
    }
}
