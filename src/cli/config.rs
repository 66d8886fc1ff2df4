//! What every subcommand shares: the `--config FILE` and logging flags ([`ConfigArgs`]), the
//! configuration overrides its other flags become ([`Overrides`]), and the message of a
//! configuration error that names where each bad value came from
//! ([`describe_config_error`]).

use std::path::{Path, PathBuf};

use clap::Args;
use sb_common::config::{
    ConfigError, ConfigLoader, DEFAULT_CONFIG_FILE, ENV_PREFIX, ENV_SEPARATOR, OverrideValue,
    SwitchboardConfig,
};

/// Flags every subcommand accepts.
#[derive(Debug, Clone, Default, Args)]
pub struct ConfigArgs {
    /// Configuration file (TOML). Without it, ./switchboard.toml is read when present.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log filter, e.g. `debug` or `info,sb_worker=debug` (telemetry.log_level; RUST_LOG wins).
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Write logs as JSON lines (telemetry.json).
    #[arg(long)]
    pub log_json: bool,
}

/// Configuration overrides collected from a subcommand's flags, in the order given.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides(pub Vec<(String, OverrideValue)>);

impl Overrides {
    /// Sets `key` to a scalar.
    pub fn set(&mut self, key: &str, value: impl ToString) {
        self.0
            .push((key.to_owned(), OverrideValue::Text(value.to_string())));
    }

    /// Sets `key` to `value` when the flag was given.
    pub fn set_opt(&mut self, key: &str, value: Option<impl ToString>) {
        if let Some(value) = value {
            self.set(key, value);
        }
    }

    /// Sets a list-valued `key` when the repeatable flag was given at least once.
    pub fn set_list<T: ToString>(&mut self, key: &str, values: &[T]) {
        if !values.is_empty() {
            self.0.push((
                key.to_owned(),
                OverrideValue::List(values.iter().map(ToString::to_string).collect()),
            ));
        }
    }

    /// The value of the last override for `key`.
    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<&OverrideValue> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl ConfigArgs {
    /// The logging overrides.
    pub fn overrides(&self, out: &mut Overrides) {
        out.set_opt("telemetry.log_level", self.log_level.as_deref());
        if self.log_json {
            out.set("telemetry.json", true);
        }
    }

    /// Loads and validates the configuration: defaults, the file, the process environment,
    /// then `extra` (the subcommand's own flags) and the logging flags.
    pub fn load(&self, extra: Overrides) -> anyhow::Result<SwitchboardConfig> {
        let mut overrides = extra;
        self.overrides(&mut overrides);
        let flags: Vec<String> = overrides.0.iter().map(|(k, _)| k.clone()).collect();
        ConfigLoader::new()
            .file_opt(self.config.as_deref())
            .process_env()
            .overrides(overrides.0)
            .load()
            .map_err(|error| {
                let file = self
                    .config
                    .clone()
                    .or_else(|| Some(PathBuf::from(DEFAULT_CONFIG_FILE)).filter(|p| p.is_file()));
                let env: Vec<String> = std::env::vars_os()
                    .filter_map(|(k, _)| k.into_string().ok())
                    .collect();
                anyhow::anyhow!(describe_config_error(&error, &env, &flags, file.as_deref()))
            })
    }

    /// [`Self::load`], then installs logging from the loaded configuration.
    pub fn load_and_init_logging(&self, extra: Overrides) -> anyhow::Result<SwitchboardConfig> {
        let config = self.load(extra)?;
        sb_common::telemetry::init(&config.telemetry)
            .map_err(|e| anyhow::anyhow!("logging: {e:#}"))?;
        tracing::debug!(?config, "configuration loaded");
        Ok(config)
    }
}

/// The message of a configuration error, printed once (the loader's error already holds
/// its cause's text, so the cause is not chained again), naming where each offending value
/// came from: the environment variable that set it (`SWITCHBOARD__GATEWAY__HTTP_ADDR`), the
/// command-line flag, or the key of the configuration file.
///
/// `env` is the names of the process environment, `flags` the keys the command's flags set,
/// `file` the configuration file read (if any).
pub fn describe_config_error(
    error: &ConfigError,
    env: &[String],
    flags: &[String],
    file: Option<&std::path::Path>,
) -> String {
    let origin = |key: &str| -> Option<String> {
        let var = format!(
            "{ENV_PREFIX}{ENV_SEPARATOR}{}",
            key.to_ascii_uppercase().replace('.', ENV_SEPARATOR)
        );
        let below = format!("{var}{ENV_SEPARATOR}");
        let mut vars: Vec<&str> = env
            .iter()
            .map(String::as_str)
            .filter(|v| v.eq_ignore_ascii_case(&var) || v.to_ascii_uppercase().starts_with(&below))
            .collect();
        vars.sort_unstable();
        if flags.iter().any(|f| f == key) {
            Some("set by a command-line flag".to_owned())
        } else if !vars.is_empty() {
            Some(format!("from environment variable {}", vars.join(", ")))
        } else {
            file.map(|f| format!("from key `{key}` of {}", f.display()))
        }
    };
    match error {
        ConfigError::Invalid(problems) => {
            let lines: Vec<String> = problems
                .iter()
                .map(|p| match origin(&p.key) {
                    Some(o) => format!("{p} ({o})"),
                    None => p.to_string(),
                })
                .collect();
            format!("invalid configuration: {}", lines.join("; "))
        }
        ConfigError::Load(inner) => {
            let text = inner.to_string();
            let key = text
                .split_once("for key `")
                .and_then(|(_, rest)| rest.split_once('`'))
                .map(|(key, _)| key.to_owned());
            match key.as_deref().and_then(origin) {
                Some(o) => format!("invalid configuration: {text} ({o})"),
                None => format!("invalid configuration: {text}"),
            }
        }
        other => other.to_string(),
    }
}

/// `paths` as the text of a list-valued override (`worker.runners_dirs`).
pub fn display_paths(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| Path::display(p).to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logging_flags_become_overrides() {
        let args = ConfigArgs {
            config: None,
            log_level: Some("debug".into()),
            log_json: true,
        };
        let mut o = Overrides::default();
        args.overrides(&mut o);
        assert_eq!(
            o.get("telemetry.log_level"),
            Some(&OverrideValue::Text("debug".into()))
        );
        assert_eq!(
            o.get("telemetry.json"),
            Some(&OverrideValue::Text("true".into()))
        );
        let mut none = Overrides::default();
        ConfigArgs::default().overrides(&mut none);
        assert!(none.0.is_empty());
    }

    #[test]
    fn config_errors_name_their_origin_once() {
        let env = |vars: &[(&str, &str)]| {
            ConfigLoader::new()
                .without_file()
                .env(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
                .load()
                .unwrap_err()
        };
        let names = |vars: &[&str]| vars.iter().map(|v| v.to_string()).collect::<Vec<_>>();
        let error = env(&[("SWITCHBOARD__GATEWAY__REQUEST_TIMEOUT", "-3")]);
        let text = describe_config_error(
            &error,
            &names(&["PATH", "SWITCHBOARD__GATEWAY__REQUEST_TIMEOUT"]),
            &[],
            None,
        );
        assert!(
            text.contains("gateway.request_timeout")
                && text
                    .ends_with("(from environment variable SWITCHBOARD__GATEWAY__REQUEST_TIMEOUT)"),
            "{text}"
        );
        assert_eq!(
            text.matches("expected a duration").count(),
            1,
            "once: {text}"
        );

        let error = env(&[
            ("SWITCHBOARD__BUS__KIND", "amqp"),
            ("SWITCHBOARD__BUS__URL", "x"),
        ]);
        let from_file = describe_config_error(&error, &[], &[], Some("sb.toml".as_ref()));
        assert!(
            from_file.contains("bus.url") && from_file.contains("from key `bus.url` of sb.toml"),
            "{from_file}"
        );
        let from_flag = describe_config_error(&error, &[], &names(&["bus.url"]), None);
        assert!(
            from_flag.contains("set by a command-line flag"),
            "{from_flag}"
        );
    }

    #[test]
    fn missing_config_file_is_an_error() {
        let args = ConfigArgs {
            config: Some("/nonexistent/switchboard.toml".into()),
            ..Default::default()
        };
        let err = args.load(Overrides::default()).unwrap_err();
        assert!(format!("{err:#}").contains("does not exist"), "{err:#}");
    }
}
