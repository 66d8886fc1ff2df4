//! The HTTP client of the gateway: what `switchboard send`, `bench`, the operator commands
//! and the tests use to talk to a running gateway.
//!
//! [`GatewayClient`] is one `reqwest` client with the gateway's base URL and the bearer key;
//! [`GatewayClient::json`] is the plain JSON request of the resource commands, and
//! [`GatewayClient::follow`] posts one event and follows the run it starts with a
//! [`RunFollower`], which survives dropped connections (see [`follow`]).
//!
//! It lives in the library, not in the binary, so that its tests (against a stand-in
//! gateway that injects faults, and against the real in-memory host) are integration tests
//! of `sb-tests` like every other scenario.
//!
//! # Layout
//! - this file: [`GatewayClient`].
//! - [`event`]: the bodies it sends and reads ([`NewEvent`], [`EventStatus`]).
//! - [`follow`]: [`RunFollower`], its options and errors.
//! - [`text`]: the text of a result ([`delta_text`], [`message_text`]).
//! - [`sse`]: reconnection delays ([`sse::Backoff`]) and the workspace's event-stream reader.

pub mod event;
pub mod follow;
pub mod sse;
pub mod text;

use std::time::Duration;

use anyhow::Context as _;
use reqwest::header::AUTHORIZATION;
use serde_json::Value;

pub use event::{EventStatus, NewEvent};
pub use follow::{EVENT_ID_HEADER, FollowError, FollowOptions, IDEMPOTENCY_KEY, RunFollower};
pub use text::{delta_text, message_text};

/// A connected client of one gateway.
#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    /// Base URL without a trailing slash.
    base: String,
    /// `Bearer <key>`, when a key is configured.
    authorization: Option<String>,
}

impl GatewayClient {
    /// A client of the gateway at `base_url` (plain `http`; this build has no TLS).
    pub fn new(base_url: &str, api_key: Option<&str>) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(base_url)
            .with_context(|| format!("invalid gateway URL `{base_url}`"))?;
        anyhow::ensure!(
            url.scheme() == "http",
            "gateway URL `{base_url}` must use http:// (this build has no TLS support)"
        );
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        // A proxy from the environment must not capture traffic to the local gateway.
        if matches!(
            url.host_str(),
            Some("localhost" | "127.0.0.1" | "[::1]" | "::1")
        ) {
            builder = builder.no_proxy();
        }
        Ok(Self {
            http: builder.build().context("cannot build the HTTP client")?,
            base: base_url.trim_end_matches('/').to_owned(),
            authorization: api_key.map(|k| format!("Bearer {k}")),
        })
    }

    /// One JSON request to `path`; the answer's JSON on a `2xx`, else an error with the
    /// gateway's `{code, message}`.
    pub async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let mut req = self.request(method, path);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .context("cannot read the gateway answer")?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let code = value["code"].as_str().unwrap_or("error");
            let message = value["message"].as_str().unwrap_or("");
            anyhow::bail!("gateway answered {status}: {code}: {message}");
        }
        Ok(value)
    }

    pub(crate) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(auth) = &self.authorization {
            req = req.header(AUTHORIZATION, auth);
        }
        req
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_urls_are_accepted() {
        assert!(GatewayClient::new("http://127.0.0.1:8080/", None).is_ok());
        assert!(GatewayClient::new("https://example.com", None).is_err());
        assert!(GatewayClient::new("not a url", None).is_err());
    }
}
