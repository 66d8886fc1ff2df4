//! Secrets by reference (SPEC §14): the only environment variables a tenant may name.
//!
//! A model's `api_key_env` and a tool's `headers_env` name an environment variable whose
//! value a worker puts in the request's headers. Any name would let a tenant make the worker
//! send *its own* configuration (bus, database and Redis URLs with their credentials) to a URL
//! of the tenant's choosing. So a name is usable only when the operator listed it in
//! `secrets.allow` ([`SecretPolicy`]), and the host's own `SWITCHBOARD*` variables can never
//! be listed ([`check_allowable`]). The gateway checks at registration (a clear `400`), and
//! every worker checks again right before reading a value ([`SecretPolicy::read`]), so a row
//! written before the policy existed, or by hand, is refused too.
//!
//! Values never leave this module except into the one request header they are for; errors
//! name the variable, never its value.

use std::collections::BTreeSet;

use serde::Deserialize;

/// Prefix of the host's own environment variables: its configuration
/// (`SWITCHBOARD__…`, read by `sb_common::config`, whose `ENV_PREFIX` is this constant) and
/// its test settings. No tenant may reference one of them as a secret.
pub const HOST_VARIABLE_PREFIX: &str = "SWITCHBOARD";

/// The `[secrets]` section of the configuration (re-exported as
/// `sb_common::config::SecretsConfig`): the secrets a tenant may reference (SPEC §14). A
/// model's `api_key_env` and a tool's `headers_env` may name only a variable listed here,
/// which the operator set on the workers (and on gateways serving the remote Host API). Registration refuses any other name, and
/// workers check again before reading one, so a key cannot make a worker send its own
/// environment to a URL of the tenant's choosing.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecretsConfig {
    /// Environment variable names, e.g. `OPENAI_API_KEY,TOOL_TOKEN` (comma-separated in the
    /// environment). The host's own `SWITCHBOARD*` variables can never be listed.
    #[serde(deserialize_with = "crate::env_list::deserialize")]
    pub allow: Vec<String>,
}

/// Why a name cannot be used as a secret reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Not an environment variable name (a pasted key, say). The text is kept for the
    /// caller but never shown: it may be the very secret that was pasted by mistake.
    #[error(
        "the value is not the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*); name the variable holding the secret, never the secret"
    )]
    NotAName(String),
    /// The host's own configuration.
    #[error("`{0}` is the host's own configuration and can never be referenced")]
    HostVariable(String),
    /// Not in `secrets.allow`.
    #[error("`{0}` is not a secret this deployment makes available (secrets.allow)")]
    NotAllowed(String),
    /// Allowed, but not set in this process's environment.
    #[error("the secret `{0}` is not set on this host")]
    Unset(String),
}

/// Whether `name` could ever be put in `secrets.allow`: an environment variable name that is
/// not one of the host's own (`SWITCHBOARD…`, any case).
///
/// # Errors
///
/// [`SecretError::NotAName`] or [`SecretError::HostVariable`].
pub fn check_allowable(name: &str) -> Result<(), SecretError> {
    let is_name = !name.is_empty()
        && name.len() <= 255
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if !is_name {
        return Err(SecretError::NotAName(name.to_owned()));
    }
    if name.to_ascii_uppercase().starts_with(HOST_VARIABLE_PREFIX) {
        return Err(SecretError::HostVariable(name.to_owned()));
    }
    Ok(())
}

/// The secrets this deployment makes available, from `secrets.allow`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretPolicy {
    allowed: BTreeSet<String>,
}

impl SecretPolicy {
    /// The policy of `secrets.allow`; names that could never be allowed are dropped (the
    /// configuration's validation already refused them).
    #[must_use]
    pub fn from_config(config: &SecretsConfig) -> Self {
        Self {
            allowed: config
                .allow
                .iter()
                .filter(|n| check_allowable(n).is_ok())
                .cloned()
                .collect(),
        }
    }

    /// Whether a model or tool may reference `name`.
    ///
    /// # Errors
    ///
    /// Why not, naming the variable only.
    pub fn check(&self, name: &str) -> Result<(), SecretError> {
        check_allowable(name)?;
        if self.allowed.contains(name) {
            Ok(())
        } else {
            Err(SecretError::NotAllowed(name.to_owned()))
        }
    }

    /// The value of an allowed secret from this process's environment.
    ///
    /// # Errors
    ///
    /// The refusal of [`SecretPolicy::check`], or [`SecretError::Unset`].
    pub fn read(&self, name: &str) -> Result<String, SecretError> {
        self.check(name)?;
        std::env::var(name).map_err(|_| SecretError::Unset(name.to_owned()))
    }

    /// The allowed names, sorted (for start-up logs; never values).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.allowed.iter().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(names: &[&str]) -> SecretPolicy {
        SecretPolicy::from_config(&SecretsConfig {
            allow: names.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    #[test]
    fn only_allowed_names_pass() {
        let p = policy(&["OPENAI_API_KEY", "TOOL_TOKEN"]);
        assert_eq!(p.check("OPENAI_API_KEY"), Ok(()));
        assert_eq!(p.check("HOME"), Err(SecretError::NotAllowed("HOME".into())));
        assert_eq!(
            p.check("sk-live 123"),
            Err(SecretError::NotAName("sk-live 123".into()))
        );
    }

    #[test]
    fn host_variables_can_never_be_allowed_or_named() {
        for name in [
            "SWITCHBOARD__DATABASE__URL",
            "SWITCHBOARD__BUS__URL",
            "switchboard__sessions__url",
            "SWITCHBOARD_API_KEY",
        ] {
            assert_eq!(
                check_allowable(name),
                Err(SecretError::HostVariable(name.into()))
            );
            let p = policy(&[name]);
            assert_eq!(p.names().count(), 0);
            assert!(p.check(name).is_err());
        }
    }

    #[test]
    fn read_refuses_what_check_refuses_and_reports_unset() {
        let p = policy(&["SB_SECRETS_TEST_SURELY_UNSET"]);
        assert_eq!(
            p.read("SB_SECRETS_TEST_SURELY_UNSET"),
            Err(SecretError::Unset("SB_SECRETS_TEST_SURELY_UNSET".into()))
        );
        // `PATH` is set in every test environment, but not allowed.
        assert_eq!(p.read("PATH"), Err(SecretError::NotAllowed("PATH".into())));
    }
}
