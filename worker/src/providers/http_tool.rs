//! HTTP tools: the call's parameters POSTed as JSON to the registered URL, with the
//! registered timeout, response size cap and static headers whose values come from
//! environment variables. Executed once, never retried (see the module docs of
//! [`super`]).

use std::collections::BTreeMap;
use std::time::Duration;

use sb_store::ToolRecord;
use serde::Deserialize;
use serde_json::Value;

use super::{ProviderError, check_url, env_value, read_capped};

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
}

/// Calls the tool; the answer is the response JSON (or the text, if it is not JSON).
/// `deadline` bounds the registered timeout (the run's remaining time).
pub async fn call(
    client: &reqwest::Client,
    tool: &ToolRecord,
    parameters: &Value,
    deadline: Option<Duration>,
) -> Result<Value, ProviderError> {
    let config = HttpToolConfig::of(tool)?;
    let what = format!("tool {}", tool.name);
    check_url(&what, &config.url)?;
    let mut timeout = Duration::from_millis(config.timeout_ms);
    if let Some(d) = deadline {
        timeout = timeout.min(d);
    }
    let mut rb = client.post(&config.url).json(parameters).timeout(timeout);
    for (header, env) in &config.headers_env {
        rb = rb.header(header.as_str(), env_value(env)?);
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
