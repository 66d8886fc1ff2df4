//! HTTP tools: the call's parameters POSTed as JSON to the registered URL, with the
//! registered timeout and response size cap (each within the deployment's ceiling, see
//! [`HttpToolConfig::within`]) and static headers whose values come from environment
//! variables. Executed once, never retried (see the module docs of [`super`]).

use std::collections::BTreeMap;
use std::time::Duration;

use sb_store::ToolRecord;
use serde::Deserialize;
use serde_json::Value;

use super::{ProviderClient, ProviderError, read_capped};

/// The `config` of an `http` tool, as `/v1/tools` stores it.
#[derive(Debug, Clone, Deserialize)]
pub struct HttpToolConfig {
    /// Where calls are POSTed.
    pub url: String,
    /// Timeout of one call.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Cap of the response body.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
    /// Header name → environment variable holding its value.
    #[serde(default)]
    pub headers_env: BTreeMap<String, String>,
}

fn default_timeout_ms() -> u64 {
    10_000
}

fn default_max_response_bytes() -> usize {
    1024 * 1024
}

impl HttpToolConfig {
    /// The config of `tool`, which must be an `http` tool.
    pub fn of(tool: &ToolRecord) -> Result<Self, ProviderError> {
        if tool.kind != "http" {
            return Err(ProviderError::Config(format!(
                "tool {} of kind {} cannot be executed by this host",
                tool.name, tool.kind
            )));
        }
        serde_json::from_value(tool.config.clone()).map_err(|_| {
            ProviderError::Config(format!("tool {} has an invalid configuration", tool.name))
        })
    }

    /// The config with its timeout and response cap lowered to the deployment's ceilings
    /// (`limits.tool_timeout_max`, `limits.tool_response_bytes_max`). The gateway refuses
    /// registrations above them, but a tool registered before an operator lowered a
    /// ceiling keeps its stored values, so execution applies the ceilings again.
    #[must_use]
    pub fn within(mut self, timeout_max: Duration, response_bytes_max: usize) -> Self {
        let timeout_max_ms = u64::try_from(timeout_max.as_millis()).unwrap_or(u64::MAX);
        self.timeout_ms = self.timeout_ms.min(timeout_max_ms);
        self.max_response_bytes = self.max_response_bytes.min(response_bytes_max);
        self
    }

    /// Timeout of one call.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// Calls the tool `name` with `config` (its [`HttpToolConfig::of`], already bounded by
/// [`HttpToolConfig::within`]); the answer is the response JSON (or the text, if it is not
/// JSON). `deadline` bounds the timeout further (the run's remaining time).
pub async fn call(
    client: &ProviderClient,
    name: &str,
    config: &HttpToolConfig,
    parameters: &Value,
    deadline: Option<Duration>,
) -> Result<Value, ProviderError> {
    let what = format!("tool {name}");
    let mut timeout = config.timeout();
    if let Some(d) = deadline {
        timeout = timeout.min(d);
    }
    let mut rb = client
        .post(&what, &config.url)?
        .json(parameters)
        .timeout(timeout);
    for (header, env) in &config.headers_env {
        rb = rb.header(header.as_str(), client.secret(env)?);
    }
    let resp = rb
        .send()
        .await
        .map_err(|e| ProviderError::from_reqwest(&what, &e))?;
    if !resp.status().is_success() {
        return Err(ProviderError::Status {
            what,
            status: resp.status().as_u16(),
        });
    }
    let body = read_capped(resp, &what, config.max_response_bytes).await?;
    Ok(match serde_json::from_slice::<Value>(&body) {
        Ok(v) => v,
        Err(_) => Value::String(String::from_utf8_lossy(&body).into_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(timeout_ms: u64, max_response_bytes: usize) -> HttpToolConfig {
        HttpToolConfig {
            url: "http://127.0.0.1:9/t".into(),
            timeout_ms,
            max_response_bytes,
            headers_env: BTreeMap::new(),
        }
    }

    #[test]
    fn within_lowers_to_the_ceilings_and_keeps_smaller_values() {
        let c = config(600_000, 64 << 20).within(Duration::from_secs(60), 1 << 20);
        assert_eq!((c.timeout_ms, c.max_response_bytes), (60_000, 1 << 20));
        assert_eq!(c.timeout(), Duration::from_secs(60));
        let c = config(2_000, 4096).within(Duration::from_secs(60), 1 << 20);
        assert_eq!((c.timeout_ms, c.max_response_bytes), (2_000, 4096));
    }
}
