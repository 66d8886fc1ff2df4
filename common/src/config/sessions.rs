//! `[sessions]`: the active-run session store (in-process or Redis).

use serde::Deserialize;

use super::problems::Problems;
use super::secret_url::SecretUrl;

/// Which session-store implementation to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionsKind {
    /// In-process store: only for a single process.
    Memory,
    /// Redis; required when roles run in separate processes.
    Redis,
}

/// The active-run session store.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsConfig {
    /// `memory` (single process) or `redis`.
    pub kind: SessionsKind,
    /// Redis URL, required for `kind = "redis"`: `redis://[:password@]host:6379[/db]`
    /// (`rediss://` for TLS).
    pub url: Option<SecretUrl>,
    /// Prefix of every key written, so several deployments (or tests) can share one Redis.
    pub key_prefix: String,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            kind: SessionsKind::Memory,
            url: None,
            key_prefix: "sb:".to_owned(),
        }
    }
}

impl SessionsConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let s = self;
        match (&s.url, s.kind) {
            (Some(url), _) => p.url("sessions.url", url, &["redis", "rediss"], false),
            (None, SessionsKind::Redis) => {
                p.push("sessions.url", "required when sessions.kind is `redis`")
            }
            (None, SessionsKind::Memory) => {}
        }
        if s.key_prefix.is_empty() {
            p.push("sessions.key_prefix", "expected a non-empty prefix");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    #[test]
    fn rejects_redis_sessions_without_url() {
        let problems = rejected("sessions.kind", "redis");
        assert_eq!(problems[0].key, "sessions.url");
    }

    #[test]
    fn rejects_sessions_url_with_wrong_scheme() {
        assert_rejected("sessions.url", "memcached://localhost:11211");
    }

    #[test]
    fn rejects_empty_key_prefix() {
        assert_rejected("sessions.key_prefix", "");
    }
}
