//! [`SecretUrl`]: connection URLs whose password never reaches a log.

use std::fmt;

use serde::Deserialize;
use url::Url;

/// A connection URL that may carry credentials.
///
/// The original text is kept verbatim (drivers get exactly what the operator wrote) and is only
/// reachable through [`SecretUrl::expose`]. `Debug` and `Display` replace the password with
/// `****`, e.g. `postgres://user:****@host/db`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a URL; it is checked by
    /// [`SwitchboardConfig::validate`](super::SwitchboardConfig::validate), not here.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The full URL including credentials. Use it only to open a connection.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Parses the URL.
    pub fn parse(&self) -> Result<Url, url::ParseError> {
        Url::parse(&self.0)
    }

    /// The scheme (`postgres`, `amqp`, …), or `None` if the text is not a URL.
    pub fn scheme(&self) -> Option<String> {
        self.parse().ok().map(|u| u.scheme().to_owned())
    }

    /// The URL with the password replaced by `****`; unparsable text is hidden entirely
    /// because we cannot tell where a password would be.
    pub fn redacted(&self) -> String {
        redact_url(self.expose())
    }
}

/// `text` as a URL with its password replaced by `****`; unparsable text is hidden entirely
/// because we cannot tell where a password would be. The one redaction of connection URLs:
/// [`SecretUrl`]'s `Debug`/`Display` and the backends' options (`AmqpOptions`, `RedisOptions`)
/// print through it.
pub fn redact_url(text: &str) -> String {
    match url::Url::parse(text) {
        Ok(mut url) => {
            if url.password().is_some() {
                // Cannot fail: a URL with a password has a host.
                let _ = url.set_password(Some("****"));
            }
            url.to_string()
        }
        Err(_) => "<unparsable url>".to_owned(),
    }
}

impl From<&str> for SecretUrl {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<String> for SecretUrl {
    fn from(s: String) -> Self {
        Self::new(s)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({:?})", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::SecretUrl;

    #[test]
    fn secret_urls_are_redacted_in_debug() {
        let c = loader()
            .set(
                "database.url",
                "postgres://user:hunter2@db.example:5432/ledger",
            )
            .set("bus.url", "amqp://guest:s3cret@rabbit:5672/%2f")
            .set("sessions.url", "redis://:redispw@redis:6379/0")
            .load()
            .unwrap();
        let debug = format!("{c:?}");
        for secret in ["hunter2", "s3cret", "redispw"] {
            assert!(!debug.contains(secret), "{secret} leaked: {debug}");
        }
        assert!(debug.contains("postgres://user:****@db.example:5432/ledger"));
        assert_eq!(
            c.database.url.expose(),
            "postgres://user:hunter2@db.example:5432/ledger"
        );
        assert_eq!(
            SecretUrl::new("not a url with password").to_string(),
            "<unparsable url>"
        );
    }
}
