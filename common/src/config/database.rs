//! `[database]`: where the ledger lives (Postgres in a cluster, SQLite embedded).

use std::num::NonZeroU32;
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::secret_url::SecretUrl;
use super::values::nz32;

/// Where the ledger lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Database URL: `postgres://user:password@host:5432/db` (also `postgresql://`) or
    /// `sqlite://path/to/file.db?mode=rwc` (`mode=rwc` creates the file if it is missing).
    /// Default: a SQLite file in `./.switchboard`, the embedded mode's data directory.
    pub url: SecretUrl,
    /// Largest number of pooled connections per process.
    pub max_connections: NonZeroU32,
    /// Connections kept open while idle; at most `max_connections`.
    pub min_connections: u32,
    /// How long to wait for a new connection before reporting the database unavailable,
    /// e.g. `5s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            // Embedded mode needs no external service; `mode=rwc` creates the file on first run.
            url: SecretUrl::new("sqlite://.switchboard/switchboard.db?mode=rwc"),
            // Every role does short transactions; 10 covers a gateway's burst of ingest
            // transactions plus the outbox relay without exhausting Postgres's default 100
            // connections when a handful of processes share one server.
            max_connections: nz32(10),
            // One warm connection hides the connect latency of the first request.
            min_connections: 1,
            // Long enough for a TLS handshake to a remote server, short enough that readiness
            // reports a dead database within one probe period.
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl DatabaseConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let db = self;
        match db.url.scheme().as_deref() {
            // `sqlite::memory:` and `sqlite:relative.db` have no host; that is fine.
            Some("sqlite") => p.url("database.url", &db.url, &["sqlite"], true),
            _ => p.url(
                "database.url",
                &db.url,
                &["postgres", "postgresql", "sqlite"],
                false,
            ),
        }
        if db.min_connections > db.max_connections.get() {
            p.push(
                "database.min_connections",
                format!(
                    "expected at most database.max_connections ({}), got {}",
                    db.max_connections, db.min_connections
                ),
            );
        }
        p.positive("database.connect_timeout", db.connect_timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    #[test]
    fn rejects_database_url_with_unknown_scheme() {
        assert_rejected("database.url", "mysql://root@localhost/db");
    }

    #[test]
    fn rejects_database_url_that_does_not_parse() {
        let problems = rejected("database.url", "postgres//user:pw@host");
        assert_eq!(problems[0].key, "database.url");
        assert!(
            !problems[0].reason.contains("pw"),
            "password echoed: {problems:?}"
        );
    }

    #[test]
    fn rejects_postgres_url_without_host() {
        assert_rejected("database.url", "postgres:///db");
    }

    #[test]
    fn rejects_min_connections_above_max() {
        let err = loader()
            .set("database.max_connections", "2")
            .set("database.min_connections", "3")
            .load()
            .unwrap_err();
        assert_eq!(err.problems()[0].key, "database.min_connections");
    }

    #[test]
    fn rejects_zero_max_connections() {
        assert_load_error("database.max_connections", "0");
    }

    #[test]
    fn rejects_zero_connect_timeout() {
        assert_rejected("database.connect_timeout", "0s");
    }

    #[test]
    fn rejects_duration_without_unit() {
        assert_load_error("database.connect_timeout", "5");
    }
}
