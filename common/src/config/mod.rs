//! The configuration tree of every Switchboard role, its loader and its validation.
//!
//! One tree ([`SwitchboardConfig`]) serves every role: `switchboard dev` runs all roles in one
//! process from one tree, and a cluster deployment gives every process the same file and
//! environment, so the roles can never disagree about shared values (shard counts, name
//! prefixes, limits).
//!
//! # Loading
//!
//! [`ConfigLoader`] merges, each layer overriding the previous one:
//!
//! 1. built-in defaults (the `impl Default` of every section; they describe the embedded mode:
//!    SQLite under `./.switchboard`, in-process bus and session store);
//! 2. a TOML file: the path given explicitly (`--config FILE`, must exist), or else
//!    `./switchboard.toml` when present;
//! 3. environment variables `SWITCHBOARD__<SECTION>__<KEY>` (`__` separates path segments, so
//!    `SWITCHBOARD__WORKER__HEARTBEAT_INTERVAL=1s` sets `worker.heartbeat_interval`);
//!    list values (`worker.pools`, `worker.runners_dirs`) may be given comma-separated;
//! 4. overrides built by the CLI from its flags (`(key, value)` pairs with dotted keys).
//!
//! The result is then checked by [`SwitchboardConfig::validate`], **before** any connection
//! is opened, so a typo in a URL fails at start-up with the offending key named instead of as
//! a connection error minutes later. Unknown keys are rejected in every layer
//! (`deny_unknown_fields`), so a misspelt variable cannot be silently ignored.
//!
//! The environment is passed to the loader as a map ([`ConfigLoader::env`]), which keeps the
//! loader a pure function of its inputs and lets tests exercise every precedence rule.
//!
//! # Secrets
//!
//! Connection URLs are [`SecretUrl`]s: their `Debug`/`Display` print the password as `****`, so
//! logging a configuration (`debug!(?config)`) never leaks credentials.
//!
//! # Layout
//! - this file: [`SwitchboardConfig`] (the tree) and [`SwitchboardConfig::validate`], which
//!   asks every section to check itself;
//! - `loader`: [`ConfigLoader`], the layers and their precedence, and [`load`];
//! - one file per section: `database`, `bus`, `sessions`, `gateway`, `orchestrator`,
//!   `worker` (with its sandbox), `providers`, `limits` (with the budgets), `retention`,
//!   `dev`; each holds the section's types, their `Default` (with the reasons for each
//!   number) and its validation rules, next to one test per rejected value;
//! - the sections of the policies that use them live with those policies and are
//!   re-exported here: [`TelemetryConfig`] in [`crate::telemetry`], [`SecretsConfig`] in
//!   [`crate::secrets`], [`EgressConfig`] in [`crate::egress`], [`RetryConfig`] in
//!   [`crate::retry`]. This module depends on them
//!   (to validate their sections), never the reverse;
//! - `problems`: [`ConfigError`], [`ConfigProblem`] and the collector the sections report
//!   into; `secret_url`: [`SecretUrl`]; `values`: sizes and non-zero literals of the defaults.

mod bus;
mod database;
mod dev;
mod gateway;
mod limits;
mod loader;
mod orchestrator;
mod problems;
mod providers;
mod retention;
mod secret_url;
mod sessions;
#[cfg(test)]
mod test_support;
mod values;
mod worker;

pub use bus::{BusConfig, BusKind, QueueType};
pub use database::DatabaseConfig;
pub use dev::{DevConfig, DevModel};
pub use gateway::GatewayConfig;
pub use limits::{BudgetsConfig, LimitsConfig};
pub use loader::{
    ConfigLoader, DEFAULT_CONFIG_FILE, ENV_PREFIX, ENV_SEPARATOR, OverrideValue, load,
};
pub use orchestrator::OrchestratorConfig;
pub use problems::{ConfigError, ConfigProblem};
pub use providers::ProvidersConfig;
pub use retention::RetentionConfig;
pub use secret_url::{SecretUrl, redact_url};
pub use sessions::{SessionsConfig, SessionsKind};
pub use worker::{SandboxConfig, WorkerConfig};

pub use crate::egress::EgressConfig;
pub use crate::retry::RetryConfig;
pub use crate::secrets::SecretsConfig;
pub use crate::telemetry::TelemetryConfig;

use problems::Problems;
use serde::Deserialize;

/// Configuration of every role. Sections that a role does not use are still validated, so one
/// file can be shared by every process of a deployment.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwitchboardConfig {
    /// The ledger database (event log, runs, transcript, artifacts, state, keys).
    pub database: DatabaseConfig,
    /// The message bus between the roles.
    pub bus: BusConfig,
    /// The active-run session store (frozen authorization, leases, steering, budgets).
    pub sessions: SessionsConfig,
    /// The HTTP gateway.
    pub gateway: GatewayConfig,
    /// The orchestrator (routing, result sink, reaper).
    pub orchestrator: OrchestratorConfig,
    /// The worker (runner processes and their Host API).
    pub worker: WorkerConfig,
    /// The model providers behind the Host API's model actions (workers and the gateway's
    /// remote Host API).
    pub providers: ProvidersConfig,
    /// Limits enforced on runners and API clients (SPEC §13).
    pub limits: LimitsConfig,
    /// What the orchestrators' retention task deletes, and when (SPEC §9).
    pub retention: RetentionConfig,
    /// The secrets tenants may reference from models and tools (SPEC §14).
    pub secrets: SecretsConfig,
    /// Where models and tools may be reached (SPEC §14).
    pub egress: EgressConfig,
    /// What `switchboard dev` sets up in workspace `default` (ignored by the role commands).
    pub dev: DevConfig,
    /// Logging.
    pub telemetry: TelemetryConfig,
    /// How the roles wait between attempts while a backend is unreachable.
    pub retry: RetryConfig,
}

impl SwitchboardConfig {
    /// Checks every rule that can be checked without connecting anywhere. Returns all problems.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        self.database.validate(&mut p);
        self.bus.validate(&mut p);
        self.sessions.validate(&mut p);
        self.gateway.validate(&mut p);
        self.orchestrator.validate(&mut p);
        self.worker.validate(&mut p);
        self.providers.validate(&mut p);
        self.limits.validate(&mut p);
        self.retention.validate(&mut p);
        self.validate_secrets(&mut p);
        self.validate_egress(&mut p);
        self.dev.validate(&mut p);
        self.validate_telemetry(&mut p);
        self.validate_retry(&mut p);
        if p.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(p.0))
        }
    }

    fn validate_secrets(&self, p: &mut Problems) {
        for name in &self.secrets.allow {
            if let Err(e) = crate::secrets::check_allowable(name) {
                p.push("secrets.allow", e.to_string());
            }
        }
    }

    fn validate_egress(&self, p: &mut Problems) {
        for entry in &self.egress.allow {
            if let Err(e) = crate::egress::AllowEntry::parse(entry) {
                p.push("egress.allow", e.to_string());
            }
        }
    }

    fn validate_retry(&self, p: &mut Problems) {
        p.positive("retry.initial", self.retry.initial);
        if self.retry.max < self.retry.initial {
            p.push("retry.max", "must not be below retry.initial");
        }
    }

    fn validate_telemetry(&self, p: &mut Problems) {
        if let Err(e) = crate::telemetry::parse_filter(&self.telemetry.log_level) {
            p.push(
                "telemetry.log_level",
                format!("expected a log filter ({e})"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::test_support::*;
    use super::values::{KIB, MIB};
    use super::*;

    #[test]
    fn retry_policy_from_the_environment_and_its_rules() {
        let config = loader()
            .env(env(&[
                ("SWITCHBOARD__RETRY__INITIAL", "20ms"),
                ("SWITCHBOARD__RETRY__MAX", "2s"),
            ]))
            .load()
            .expect("valid");
        assert_eq!(config.retry.policy().delay(0), Duration::from_millis(20));
        assert_eq!(config.retry.policy().delay(20), Duration::from_secs(2));
        assert_rejected("retry.initial", "0s");
        let problems = loader()
            .set("retry.initial", "2s")
            .set("retry.max", "1s")
            .load()
            .map(|_| ())
            .expect_err("max below initial");
        assert!(problems.to_string().contains("retry.max"), "{problems}");
    }

    #[test]
    fn defaults_are_valid_and_embedded() {
        let config = loader().load().expect("defaults must validate");
        assert_eq!(config.bus.kind, BusKind::Memory);
        assert_eq!(config.sessions.kind, SessionsKind::Memory);
        assert_eq!(config.database.url.scheme().as_deref(), Some("sqlite"));
        assert_eq!(config.worker.heartbeat_interval, Duration::from_secs(3));
        assert_eq!(config.worker.lease_ttl, Duration::from_secs(10));
        assert_eq!(config.worker.max_line_bytes.get(), 4 * MIB);
        assert_eq!(config.gateway.max_body_bytes.get(), MIB);
        assert_eq!(config.limits.state_value_bytes.get(), 256 * KIB);
        assert_eq!(config.limits.budgets.max_tool_calls.get(), 32);
        assert_eq!(
            config.orchestrator.default_run_timeout,
            Duration::from_secs(300)
        );
        assert_eq!(config.providers.model_timeout, Duration::from_secs(120));
        assert_eq!(
            config.providers.stream_idle_timeout,
            Duration::from_secs(60)
        );
        assert_eq!(config.providers.max_attempts.get(), 3);
        assert_eq!(config.providers.retry_backoff, Duration::from_millis(250));
        assert_eq!(config.providers.max_response_bytes.get(), 8 * MIB);
        SwitchboardConfig::default().validate().unwrap();
    }

    #[test]
    fn validation_reports_every_problem() {
        let err = loader()
            .set("bus.kind", "amqp")
            .set("sessions.kind", "redis")
            .load()
            .unwrap_err();
        let keys: Vec<_> = err.problems().iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["bus.url", "sessions.url"]);
        let msg = err.to_string();
        assert!(
            msg.contains("bus.url: required when bus.kind is `amqp`"),
            "{msg}"
        );
    }

    #[test]
    fn accepts_every_documented_url_scheme() {
        for url in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgresql://u:p@db/x",
            "sqlite://.switchboard/switchboard.db?mode=rwc",
            "sqlite::memory:",
            "sqlite:relative.db",
        ] {
            loader()
                .set("database.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        for url in ["amqp://guest:guest@127.0.0.1:5672/%2f", "amqps://h/vhost"] {
            loader()
                .set("bus.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        for url in ["redis://127.0.0.1:6379", "rediss://:pw@h:6380/1"] {
            loader()
                .set("sessions.url", url)
                .load()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    #[test]
    fn rejects_bad_log_filter() {
        assert_rejected("telemetry.log_level", "info,=[");
    }

    #[test]
    fn rejects_non_boolean_json_flag() {
        assert_load_error("telemetry.json", "maybe");
    }
}
