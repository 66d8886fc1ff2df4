//! [`ConfigLoader`]: defaults → file → environment → CLI overrides, then `validate()` (see the
//! parent module for the precedence and why the environment is passed in as a map).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::SwitchboardConfig;
use super::problems::ConfigError;

/// Prefix of the environment variables read by the loader (followed by `__`). It is the
/// prefix that marks the host's own variables, which no tenant may reference as a secret
/// ([`crate::secrets::HOST_VARIABLE_PREFIX`]): one constant, so the two cannot drift apart.
pub const ENV_PREFIX: &str = crate::secrets::HOST_VARIABLE_PREFIX;
/// Separator between path segments in environment variable names.
pub const ENV_SEPARATOR: &str = "__";
/// File read when no explicit `--config` is given, relative to the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "switchboard.toml";

/// A value given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OverrideValue {
    /// A scalar; converted to the field's type like any other layer's text.
    Text(String),
    /// A list (repeatable flags such as `--runners-dir`).
    List(Vec<String>),
}

impl From<&str> for OverrideValue {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}

impl From<String> for OverrideValue {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

impl From<Vec<String>> for OverrideValue {
    fn from(v: Vec<String>) -> Self {
        Self::List(v)
    }
}

impl From<OverrideValue> for config::Value {
    fn from(v: OverrideValue) -> Self {
        match v {
            OverrideValue::Text(s) => s.into(),
            OverrideValue::List(items) => items.into(),
        }
    }
}

/// Which file layer to read.
#[derive(Debug, Clone)]
enum FileLayer {
    /// No file at all.
    None,
    /// `<dir>/switchboard.toml` when it exists.
    Discover(PathBuf),
    /// This file; it must exist.
    Explicit(PathBuf),
}

/// Builds a [`SwitchboardConfig`] from defaults, a file, the environment and CLI overrides,
/// then validates it. See the module docs for the precedence.
///
/// ```
/// # use std::collections::HashMap;
/// use sb_common::config::ConfigLoader;
/// let env = HashMap::from([("SWITCHBOARD__WORKER__SLOTS".to_owned(), "4".to_owned())]);
/// let config = ConfigLoader::new()
///     .without_file()
///     .env(env)
///     .set("telemetry.json", "true")
///     .load()
///     .unwrap();
/// assert_eq!(config.worker.slots.get(), 4);
/// assert!(config.telemetry.json);
/// ```
#[derive(Debug, Clone)]
pub struct ConfigLoader {
    file: FileLayer,
    env: BTreeMap<String, String>,
    overrides: Vec<(String, OverrideValue)>,
}

impl Default for ConfigLoader {
    fn default() -> Self {
        Self::new()
    }
}

impl ConfigLoader {
    /// Defaults, plus `./switchboard.toml` if present; no environment until [`Self::env`] or
    /// [`Self::process_env`] is called.
    pub fn new() -> Self {
        Self {
            file: FileLayer::Discover(PathBuf::from(".")),
            env: BTreeMap::new(),
            overrides: Vec::new(),
        }
    }

    /// Reads this file (TOML) instead of discovering `switchboard.toml`; it must exist.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = FileLayer::Explicit(path.into());
        self
    }

    /// Reads `switchboard.toml` from `dir` (if present) instead of the working directory.
    pub fn discover_in(mut self, dir: impl Into<PathBuf>) -> Self {
        self.file = FileLayer::Discover(dir.into());
        self
    }

    /// Reads `path` if `Some`, else discovers `./switchboard.toml` (the `--config` flag).
    pub fn file_opt(self, path: Option<impl Into<PathBuf>>) -> Self {
        match path {
            Some(path) => self.file(path),
            None => self,
        }
    }

    /// Reads no file at all.
    pub fn without_file(mut self) -> Self {
        self.file = FileLayer::None;
        self
    }

    /// Uses these environment variables; only names starting with `SWITCHBOARD__` are read.
    /// Replaces any environment given before.
    pub fn env<K, V>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        self.env = vars
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self
    }

    /// Uses the process environment (non-Unicode variables are skipped).
    pub fn process_env(self) -> Self {
        self.env(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// Adds a CLI override for a dotted key (`gateway.http_addr`); later calls win.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<OverrideValue>) -> Self {
        self.overrides.push((key.into(), value.into()));
        self
    }

    /// Adds several overrides in order.
    pub fn overrides<K, V>(mut self, pairs: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<OverrideValue>,
    {
        for (k, v) in pairs {
            self.overrides.push((k.into(), v.into()));
        }
        self
    }

    /// Merges the layers and validates the result.
    pub fn load(self) -> Result<SwitchboardConfig, ConfigError> {
        let config = self.merge()?;
        config.validate()?;
        Ok(config)
    }

    /// Merges the layers without validating (for tools that print or fix a configuration).
    pub fn merge(self) -> Result<SwitchboardConfig, ConfigError> {
        let mut builder = config::Config::builder();
        match &self.file {
            FileLayer::None => {}
            FileLayer::Discover(dir) => {
                let path = dir.join(DEFAULT_CONFIG_FILE);
                if path.is_file() {
                    builder = builder.add_source(toml_file(&path));
                }
            }
            FileLayer::Explicit(path) => {
                if !path.is_file() {
                    return Err(ConfigError::MissingFile(path.clone()));
                }
                builder = builder.add_source(toml_file(path));
            }
        }
        // Only `SWITCHBOARD__*` names are read (matched case-insensitively by `config`), so
        // `SWITCHBOARD_TEST_DATABASE_URL` and unrelated variables are ignored.
        let env: config::Map<String, String> = self.env.into_iter().collect();
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .separator(ENV_SEPARATOR)
                .source(Some(env)),
        );
        for (key, value) in self.overrides {
            builder = builder.set_override(key, value)?;
        }
        Ok(builder.build()?.try_deserialize()?)
    }
}

fn toml_file(path: &Path) -> config::File<config::FileSourceFile, config::FileFormat> {
    config::File::from(path)
        .format(config::FileFormat::Toml)
        .required(true)
}

/// Convenience used by role binaries: `--config` file (or discovery), the process
/// environment, then the CLI overrides; validated.
pub fn load(
    file: Option<&Path>,
    overrides: impl IntoIterator<Item = (String, OverrideValue)>,
) -> Result<SwitchboardConfig, ConfigError> {
    ConfigLoader::new()
        .file_opt(file)
        .process_env()
        .overrides(overrides)
        .load()
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use std::path::PathBuf;
    use std::time::Duration;

    use super::super::{BusKind, QueueType, SessionsKind};
    use super::*;

    #[test]
    fn each_layer_overrides_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("custom.toml");
        std::fs::write(
            &file,
            r#"
            [worker]
            slots = 2
            heartbeat_interval = "2s"
            cancel_grace = "7s"
            [gateway]
            http_addr = "0.0.0.0:9000"
            "#,
        )
        .unwrap();

        // File over defaults.
        let c = loader().file(&file).load().unwrap();
        assert_eq!(c.worker.slots.get(), 2);
        assert_eq!(c.worker.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(c.gateway.http_addr.port(), 9000);
        assert_eq!(
            c.worker.lease_ttl,
            Duration::from_secs(10),
            "untouched default"
        );

        // Environment over file.
        let vars = env(&[
            ("SWITCHBOARD__WORKER__SLOTS", "3"),
            ("SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL", "1s"),
            ("SWITCHBOARD_TEST_DATABASE_URL", "ignored://x"),
            ("PATH", "/bin"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 3);
        assert_eq!(c.worker.heartbeat_interval, Duration::from_secs(1));
        assert_eq!(
            c.worker.cancel_grace,
            Duration::from_secs(7),
            "file value kept"
        );

        // CLI over environment.
        let c = loader()
            .file(&file)
            .env(vars)
            .set("worker.slots", "4")
            .load()
            .unwrap();
        assert_eq!(c.worker.slots.get(), 4);
        assert_eq!(
            c.worker.heartbeat_interval,
            Duration::from_secs(1),
            "env value kept"
        );

        // Later CLI overrides win over earlier ones.
        let c = loader()
            .set("worker.slots", "4")
            .set("worker.slots", "5")
            .load()
            .unwrap();
        assert_eq!(c.worker.slots.get(), 5);
    }

    #[test]
    fn discovers_switchboard_toml_and_explicit_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let c = ConfigLoader::new().discover_in(dir.path()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 16, "no file: defaults");

        std::fs::write(
            dir.path().join(DEFAULT_CONFIG_FILE),
            "[worker]\nslots = 9\n",
        )
        .unwrap();
        let c = ConfigLoader::new().discover_in(dir.path()).load().unwrap();
        assert_eq!(c.worker.slots.get(), 9);

        let missing = dir.path().join("nope.toml");
        assert!(matches!(
            ConfigLoader::new().file(&missing).load(),
            Err(ConfigError::MissingFile(p)) if p == missing
        ));
    }

    #[test]
    fn environment_reaches_every_kind_of_field() {
        let c = loader()
            .env(env(&[
                ("SWITCHBOARD__BUS__KIND", "amqp"),
                (
                    "SWITCHBOARD__BUS__URL",
                    "amqp://guest:guest@rabbitmq:5672/%2f",
                ),
                ("SWITCHBOARD__BUS__QUEUE_TYPE", "classic"),
                ("SWITCHBOARD__SESSIONS__KIND", "redis"),
                ("SWITCHBOARD__SESSIONS__URL", "redis://redis:6379"),
                ("SWITCHBOARD__WORKER__POOLS", "default, gpu"),
                ("SWITCHBOARD__WORKER__RUNNERS_DIRS", "/app/runners,/extra"),
                ("SWITCHBOARD__TELEMETRY__JSON", "true"),
                ("SWITCHBOARD__LIMITS__BUDGETS__MAX_MODEL_CALLS", "3"),
                ("SWITCHBOARD__DATABASE__MIN_CONNECTIONS", "0"),
            ]))
            .load()
            .unwrap();
        assert_eq!(c.bus.kind, BusKind::Amqp);
        assert_eq!(c.bus.queue_type, QueueType::Classic);
        assert_eq!(c.sessions.kind, SessionsKind::Redis);
        assert_eq!(c.worker.pools, vec!["default", "gpu"]);
        assert_eq!(
            c.worker.runners_dirs,
            vec![PathBuf::from("/app/runners"), PathBuf::from("/extra")]
        );
        assert!(c.telemetry.json);
        assert_eq!(c.limits.budgets.max_model_calls.get(), 3);
        assert_eq!(c.database.min_connections, 0);
    }

    #[test]
    fn cli_list_override() {
        let c = loader()
            .set(
                "worker.runners_dirs",
                vec!["a,b".to_owned(), "c".to_owned()],
            )
            .load()
            .unwrap();
        // A list override is taken verbatim: commas inside a path are not split.
        assert_eq!(
            c.worker.runners_dirs,
            vec![PathBuf::from("a,b"), PathBuf::from("c")]
        );
    }

    #[test]
    fn unknown_keys_are_rejected_in_every_layer() {
        let err = loader()
            .env(env(&[("SWITCHBOARD__WORKER__SLOTZ", "3")]))
            .load()
            .unwrap_err();
        assert!(err.to_string().contains("slotz"), "{err}");
        let err = loader().set("nosuch.section", "1").load().unwrap_err();
        assert!(err.to_string().contains("nosuch"), "{err}");
    }
}
