//! Where the gateway commands find the gateway and its API key: the shared flags
//! ([`GatewayClientArgs`], and [`GatewayCommandArgs`] with `--json`), the dev key file
//! fallback ([`api_key_or_default`]), and the [`GatewayClient`] they make.
//!
//! Every command that talks to a running gateway (`send`, `bench`, `keys … --url`, `models`,
//! `runs`, `sessions`, …) flattens these flags and builds its client here, so the key is
//! resolved the same way everywhere.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use serde_json::Value;

use crate::client::GatewayClient;

/// Gateway URL used when `--url` and `SWITCHBOARD_URL` are absent (the `dev` default address).
pub const DEFAULT_GATEWAY_URL: &str = "http://127.0.0.1:8080";

/// Where the client finds the gateway and its API key. The flags are `global`: a command
/// with subcommands accepts them before or after the subcommand (`models --url U list` and
/// `models list --url U` are the same), and no subcommand may define a flag of these names.
#[derive(Debug, Clone, Args)]
pub struct GatewayClientArgs {
    /// Base URL of the gateway.
    #[arg(
        long,
        global = true,
        env = "SWITCHBOARD_URL",
        default_value = DEFAULT_GATEWAY_URL,
        value_name = "URL"
    )]
    pub url: String,
    /// API key (`switchboard keys create` prints one). Prefer --api-key-file or the
    /// environment: command lines are visible to other users of the machine.
    #[arg(
        long,
        global = true,
        env = "SWITCHBOARD_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,
    /// File containing the API key (surrounding whitespace is ignored). Without a key,
    /// ./.switchboard/api-key (kept by `switchboard dev`) is read when it exists.
    #[arg(long, global = true, value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
}

impl GatewayClientArgs {
    /// The API key from `--api-key`/`SWITCHBOARD_API_KEY` or `--api-key-file`, if any.
    pub fn api_key(&self) -> anyhow::Result<Option<String>> {
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read API key file {}", path.display()))?;
            let key = text.trim();
            anyhow::ensure!(!key.is_empty(), "API key file {} is empty", path.display());
            return Ok(Some(key.to_owned()));
        }
        Ok(self
            .api_key
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned))
    }

    /// The API key of the flags or the environment, else `./.switchboard/api-key` (kept by
    /// `switchboard dev`) when it exists.
    pub fn resolved_api_key(&self) -> anyhow::Result<Option<String>> {
        api_key_or_default(self.api_key()?, std::path::Path::new(DEV_API_KEY_FILE))
    }

    /// A client of the gateway, with the key of [`Self::resolved_api_key`].
    pub fn client(&self) -> anyhow::Result<GatewayClient> {
        let key = self.resolved_api_key()?;
        GatewayClient::new(&self.url, key.as_deref())
    }
}

/// Flags of every gateway command: where the gateway is (`--url`, `--api-key*`, accepted
/// before or after the subcommand) and `--json`.
#[derive(Debug, Clone, Args)]
pub struct GatewayCommandArgs {
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
    /// Print the gateway's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

impl GatewayCommandArgs {
    /// A client of the gateway, with the key of the flags, the environment or the dev key
    /// file.
    pub fn client(&self) -> anyhow::Result<GatewayClient> {
        self.gateway.client()
    }
}

/// File holding the API key that `switchboard dev` keeps in its default data directory,
/// relative to the working directory. `send` and `bench` read it when no key is given.
pub const DEV_API_KEY_FILE: &str = ".switchboard/api-key";

/// `explicit` (from the flags or the environment), else the trimmed content of
/// `default_file` when that file exists, else no key.
pub fn api_key_or_default(
    explicit: Option<String>,
    default_file: &std::path::Path,
) -> anyhow::Result<Option<String>> {
    if explicit.is_some() {
        return Ok(explicit);
    }
    match std::fs::read_to_string(default_file) {
        Ok(text) => Ok(Some(text.trim().to_owned()).filter(|k| !k.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => {
            Err(e).with_context(|| format!("cannot read API key file {}", default_file.display()))
        }
    }
}

/// Parses the JSON object of `--flag`.
pub fn json_flag(flag: &str, text: Option<&str>) -> anyhow::Result<Option<Value>> {
    text.map(|t| serde_json::from_str(t).with_context(|| format!("--{flag} is not valid JSON")))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_falls_back_to_the_dev_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("api-key");
        assert_eq!(
            api_key_or_default(None, &file).unwrap(),
            None,
            "no file: no key"
        );
        std::fs::write(&file, "sbk_dev\n").unwrap();
        assert_eq!(
            api_key_or_default(None, &file).unwrap().as_deref(),
            Some("sbk_dev")
        );
        assert_eq!(
            api_key_or_default(Some("flag".into()), &file)
                .unwrap()
                .as_deref(),
            Some("flag")
        );
        std::fs::write(&file, " \n").unwrap();
        assert_eq!(api_key_or_default(None, &file).unwrap(), None);
        assert!(
            api_key_or_default(None, dir.path()).is_err(),
            "a directory is not a key"
        );
    }
}
