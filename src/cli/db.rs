//! Opening the ledger database from the configuration.
//!
//! SQLite URLs get two conveniences here, because `switchboard dev` and `switchboard migrate`
//! must work on a fresh checkout: the parent directory of the database file is created, and
//! the connection may ask SQLite to create the file (`mode=rwc`).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use sb_common::config::SwitchboardConfig;
use sb_migrations::{Migrator, MigratorTrait as _};
use sb_store::{SqlStore, SqlStoreOptions, StoreLimits};

/// Builds `sqlite://<absolute path>?mode=rwc` for a database file. The path is made absolute
/// (so the URL does not depend on the working directory of a later process) and
/// percent-encoded (SQLx decodes it), so spaces, `?` and `#` in paths survive.
pub fn sqlite_url_for_file(path: &Path) -> anyhow::Result<String> {
    let absolute =
        std::path::absolute(path).with_context(|| format!("cannot resolve {}", path.display()))?;
    let text = absolute
        .to_str()
        .with_context(|| format!("{} is not valid UTF-8", absolute.display()))?;
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    Ok(format!("sqlite://{encoded}?mode=rwc"))
}

/// The file a SQLite URL points at, as SQLx reads it (`sqlite://path`, `sqlite:path`, with
/// percent-decoding); `None` for other schemes and for in-memory databases.
pub fn sqlite_file(url: &str) -> Option<PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let (database, params) = rest.split_once('?').unwrap_or((rest, ""));
    if database.is_empty()
        || database == ":memory:"
        || params.split('&').any(|p| p == "mode=memory")
    {
        return None;
    }
    Some(PathBuf::from(percent_decode(database)?))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Adds `mode=rwc` to a SQLite file URL that sets no `mode`, so connecting creates the file.
pub fn with_sqlite_create_mode(url: &str) -> String {
    if sqlite_file(url).is_none() {
        return url.to_owned();
    }
    match url.split_once('?') {
        Some((_, params)) if params.split('&').any(|p| p.starts_with("mode=")) => url.to_owned(),
        Some(_) => format!("{url}&mode=rwc"),
        None => format!("{url}?mode=rwc"),
    }
}

/// The store options the configuration asks for: pool sizes, the connect timeout (also
/// the wait for a pooled connection) and the value size limits.
pub fn store_options(config: &SwitchboardConfig, migrate: bool) -> SqlStoreOptions {
    let db = &config.database;
    let limits = &config.limits;
    SqlStoreOptions {
        max_connections: db.max_connections.get(),
        min_connections: db.min_connections,
        acquire_timeout: db.connect_timeout,
        migrate,
        limits: StoreLimits {
            max_state_value_bytes: limits.state_value_bytes.get(),
            max_storage_value_bytes: Some(limits.storage_value_bytes.get()),
            max_artifact_bytes: limits.artifact_read_max_bytes.get(),
        },
        ..SqlStoreOptions::default()
    }
}

/// Opens the store as configured (without migrating). With `create_sqlite`, a missing SQLite
/// file and its directory are created.
pub async fn connect(config: &SwitchboardConfig, create_sqlite: bool) -> anyhow::Result<SqlStore> {
    let mut url = config.database.url.expose().to_owned();
    if create_sqlite {
        if let Some(file) = sqlite_file(&url) {
            if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
        }
        url = with_sqlite_create_mode(&url);
    }
    SqlStore::connect(&url, &store_options(config, false))
        .await
        .with_context(|| format!("cannot connect to {}", config.database.url))
}

/// Fails with a hint when the database has migrations that were not applied (e.g. a fresh
/// database before `switchboard migrate`).
pub async fn ensure_migrated(store: &SqlStore) -> anyhow::Result<()> {
    let pending = Migrator::get_pending_migrations_read_only(store.connection())
        .await
        .context("cannot read the migration state")?;
    anyhow::ensure!(
        pending.is_empty(),
        "the database has {} pending migration(s); run `switchboard migrate` first",
        pending.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_file_follows_sqlx_parsing() {
        assert_eq!(
            sqlite_file("sqlite://.switchboard/switchboard.db?mode=rwc"),
            Some(PathBuf::from(".switchboard/switchboard.db"))
        );
        assert_eq!(sqlite_file("sqlite:rel.db"), Some(PathBuf::from("rel.db")));
        assert_eq!(
            sqlite_file("sqlite:///abs/a%20b.db"),
            Some(PathBuf::from("/abs/a b.db"))
        );
        assert_eq!(sqlite_file("sqlite::memory:"), None);
        assert_eq!(sqlite_file("sqlite://x.db?mode=memory"), None);
        assert_eq!(sqlite_file("postgres://h/db"), None);
    }

    #[test]
    fn url_for_file_round_trips() {
        for name in ["plain.db", "with space.db", "q?h#p%.db", "ünï.db"] {
            let path = std::env::temp_dir().join("sb dir").join(name);
            let url = sqlite_url_for_file(&path).unwrap();
            assert!(url.ends_with("?mode=rwc"), "{url}");
            assert_eq!(sqlite_file(&url), Some(path), "{url}");
            // The URL is acceptable to the configuration validation as well.
            sb_common::config::ConfigLoader::new()
                .without_file()
                .set("database.url", url.as_str())
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    #[test]
    fn create_mode_is_added_only_when_missing() {
        assert_eq!(
            with_sqlite_create_mode("sqlite:a.db"),
            "sqlite:a.db?mode=rwc"
        );
        assert_eq!(
            with_sqlite_create_mode("sqlite://a.db?cache=shared"),
            "sqlite://a.db?cache=shared&mode=rwc"
        );
        assert_eq!(
            with_sqlite_create_mode("sqlite://a.db?mode=ro"),
            "sqlite://a.db?mode=ro"
        );
        assert_eq!(
            with_sqlite_create_mode("sqlite::memory:"),
            "sqlite::memory:"
        );
        assert_eq!(with_sqlite_create_mode("postgres://h/d"), "postgres://h/d");
    }
}
