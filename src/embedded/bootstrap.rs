//! The bootstrap of a data directory for a local user (`switchboard dev`, the test
//! harness; the parent module's docs, "Bootstrap"): workspace `default` and the operator's
//! API key in `<data-dir>/api-key`. The default agent is [`crate::default_agent`]'s.
//!
//! Kept apart from the wiring: it is the only part of the start that writes files and
//! handles a secret.

use std::path::{Path, PathBuf};

use sb_protocol::ids::{AgentId, WorkspaceId};
use sb_store::{ApiKeyRole, Stores};

use super::StartError;
use crate::default_agent::DefaultAgentReport;

/// File name of the API key inside the data directory.
pub const API_KEY_FILE: &str = "api-key";

/// What the bootstrap of a data directory does (see the module docs).
#[derive(Debug, Clone)]
pub struct Bootstrap {
    /// Where the API key file is kept (created if missing).
    pub data_dir: PathBuf,
    /// Create (or converge) the default agent: the local agent on the `[dev]` model, or
    /// the echo runner.
    pub default_agent: bool,
}

impl Bootstrap {
    /// Bootstrap `data_dir`, with the default agent.
    #[must_use]
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            default_agent: true,
        }
    }
}

/// What the bootstrap found or created.
#[derive(Clone)]
pub struct BootstrapReport {
    /// The API key of workspace `default` (from the key file, or just created).
    pub api_key: String,
    /// `<data-dir>/api-key`.
    pub api_key_file: PathBuf,
    /// `true` when the key was created by this start (show it once).
    pub api_key_created: bool,
    /// The agent created by this start, if any.
    pub default_agent: Option<AgentId>,
    /// The default agent and model after this start (with [`Bootstrap::default_agent`]).
    pub agent: Option<DefaultAgentReport>,
}

impl std::fmt::Debug for BootstrapReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapReport")
            .field("api_key", &"****")
            .field("api_key_file", &self.api_key_file)
            .field("api_key_created", &self.api_key_created)
            .field("default_agent", &self.default_agent)
            .field("agent", &self.agent)
            .finish()
    }
}

/// Workspace `default` and its admin API key: the one in `<data-dir>/api-key` if it still
/// authenticates as an admin key of `default`, else a new one written there (mode 0600). The
/// key is `admin` because it is the operator's: it creates the default agent, and `send`,
/// the README's `curl` examples and `switchboard keys` use it.
pub(super) async fn bootstrap_key(
    stores: &Stores,
    data_dir: &Path,
) -> Result<BootstrapReport, StartError> {
    let workspace = WorkspaceId::default_workspace();
    let store_err = |source| StartError::Store {
        during: "the bootstrap",
        source,
    };
    stores
        .tenancy
        .ensure_workspace(&workspace)
        .await
        .map_err(store_err)?;
    std::fs::create_dir_all(data_dir).map_err(|source| StartError::DataDir {
        path: data_dir.to_path_buf(),
        source,
    })?;
    let file = data_dir.join(API_KEY_FILE);
    if let Ok(text) = std::fs::read_to_string(&file) {
        let key = text.trim();
        let valid = match stores.tenancy.authenticate(key).await.map_err(store_err)? {
            Some(found) => found.workspace_id == workspace && found.role == ApiKeyRole::Admin,
            None => false,
        };
        if !key.is_empty() && valid {
            return Ok(BootstrapReport {
                api_key: key.to_owned(),
                api_key_file: file,
                api_key_created: false,
                default_agent: None,
                agent: None,
            });
        }
        tracing::warn!(file = %file.display(), "the API key file holds no valid admin key for workspace default; creating a new key");
    }
    let key = stores
        .tenancy
        .create_api_key(&workspace, Some("switchboard dev"), ApiKeyRole::Admin)
        .await
        .map_err(store_err)?;
    write_secret(&file, &key.plaintext).map_err(|source| StartError::DataDir {
        path: file.clone(),
        source,
    })?;
    tracing::info!(key_id = %key.record.id, prefix = %key.record.prefix, file = %file.display(), "API key created");
    Ok(BootstrapReport {
        api_key: key.plaintext,
        api_key_file: file,
        api_key_created: true,
        default_agent: None,
        agent: None,
    })
}

/// Writes `secret` and a newline to `path`, readable by the owner only, replacing the file
/// atomically (a reader never sees a half-written key).
fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        open.mode(0o600);
    }
    let mut file = open.open(&tmp)?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn secrets_are_written_for_the_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(API_KEY_FILE);
        write_secret(&path, "sb_one").unwrap();
        write_secret(&path, "sb_two").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "sb_two\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!path.with_extension("tmp").exists());
    }
}
