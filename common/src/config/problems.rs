//! Why a configuration is refused: [`ConfigError`], the [`ConfigProblem`]s it lists, and the
//! collector the sections' `validate` methods report into, so one start-up names every
//! problem at once.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::secret_url::SecretUrl;

/// Why a configuration could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer could not be read or merged, or a value has the wrong type (the message names
    /// the key and the source).
    #[error("cannot load configuration: {0}")]
    Load(#[from] config::ConfigError),
    /// The explicit `--config` file does not exist.
    #[error("configuration file {} does not exist", .0.display())]
    MissingFile(PathBuf),
    /// The merged configuration violates one or more rules; every problem is listed.
    #[error("invalid configuration: {}", format_problems(.0))]
    Invalid(Vec<ConfigProblem>),
}

impl ConfigError {
    /// The validation problems, empty for load errors.
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            Self::Invalid(problems) => problems,
            _ => &[],
        }
    }
}

fn format_problems(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One rejected value: the dotted key and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Dotted path of the offending key, e.g. `bus.url`.
    pub key: String,
    /// What is wrong, phrased as what was expected (lowercase, no trailing period).
    pub reason: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

/// Collects problems so that one start-up reports all of them at once.
#[derive(Default)]
pub(super) struct Problems(pub(super) Vec<ConfigProblem>);

impl Problems {
    pub(super) fn push(&mut self, key: &str, reason: impl Into<String>) {
        self.0.push(ConfigProblem {
            key: key.to_owned(),
            reason: reason.into(),
        });
    }

    pub(super) fn positive(&mut self, key: &str, d: Duration) {
        if d.is_zero() {
            self.push(key, "expected a duration greater than zero");
        }
    }

    /// Checks that `url` parses, has one of `schemes` and, unless `allow_no_host`, a host.
    pub(super) fn url(
        &mut self,
        key: &str,
        url: &SecretUrl,
        schemes: &[&str],
        allow_no_host: bool,
    ) {
        let parsed = match url.parse() {
            Ok(u) => u,
            Err(e) => {
                // The text may contain a password: never echo it.
                self.push(key, format!("expected a URL ({e})"));
                return;
            }
        };
        if !schemes.contains(&parsed.scheme()) {
            self.push(
                key,
                format!(
                    "expected a URL with scheme {}, got `{}`",
                    schemes.join(" or "),
                    parsed.scheme()
                ),
            );
            return;
        }
        if !allow_no_host && parsed.host_str().is_none_or(str::is_empty) {
            self.push(key, format!("expected a host in {}", url.redacted()));
        }
    }

    /// Names that become parts of queue names, routing keys or Redis keys.
    pub(super) fn name(&mut self, key: &str, value: &str, extra: &[char]) {
        let ok = !value.is_empty()
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || extra.contains(&c));
        if !ok {
            let extra: String = extra.iter().collect();
            self.push(
                key,
                format!("expected a non-empty name of [A-Za-z0-9_-{extra}], got `{value}`"),
            );
        }
    }
}
