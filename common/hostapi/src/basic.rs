//! [`BasicHostApi`]: the Host API of a host without stores or resource providers.
//!
//! It is the one "nothing is granted" implementation, usable two ways: directly as a
//! [`HostApi`] (a runner host in tests, with no session store behind it), or as the
//! [`Dispatcher`] behind an [`ApiGate`](crate::api_gate::ApiGate) (the gate's own tests, and
//! the gate's default). Both answer exactly alike:
//!
//! - `get_host_version` → [`host_version`] (version, protocol, host);
//! - `ping` → `{}`;
//! - any other action of the protocol → `unauthorized` (nothing can be granted without a
//!   provider; never a fake success);
//! - a name outside the protocol → `not_found`.

use async_trait::async_trait;
use sb_protocol::action::Action;
use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::ids::RunId;
use serde_json::{Value, json};

use crate::api::{ApiStream, CallerIdentity, Dispatcher, GatedCall, HostApi, host_version};

/// The Host API of a host without resource providers (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct BasicHostApi;

impl BasicHostApi {
    /// The answer to `action`, whoever asks.
    fn answer(action: &str) -> Result<Value, AgentApiError> {
        match Action::parse(action) {
            Some(Action::GetHostVersion) => Ok(host_version()),
            Some(Action::Ping) => Ok(json!({})),
            Some(_) => Err(AgentApiError::new(
                ErrorCode::Unauthorized,
                format!("{action} is not available to this agent run"),
            )),
            None => Err(AgentApiError::new(
                ErrorCode::NotFound,
                format!("unknown host api action `{action}`"),
            )),
        }
    }
}

#[async_trait]
impl HostApi for BasicHostApi {
    async fn call(
        &self,
        _caller: &CallerIdentity,
        _run_id: RunId,
        action: &str,
        _params: Value,
        _stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        Self::answer(action)
    }
}

#[async_trait]
impl Dispatcher for BasicHostApi {
    async fn dispatch(
        &self,
        call: GatedCall<'_>,
        _params: Value,
        _stream: &ApiStream,
    ) -> Result<Value, AgentApiError> {
        Self::answer(call.action)
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::api::HOST_VERSION;

    #[tokio::test]
    async fn basic_host_api_answers() {
        let (tx, _rx) = mpsc::channel(1);
        let stream = ApiStream::new("1", tx);
        let caller = CallerIdentity::for_runner(&"plugin:a/b/c".parse().unwrap());
        assert_eq!(caller.plugin_id, "a/b");
        let api = BasicHostApi;
        let v = api
            .call(
                &caller,
                RunId::new(),
                "get_host_version",
                json!({}),
                &stream,
            )
            .await
            .unwrap();
        assert_eq!(v["version"], HOST_VERSION);
        let e = api
            .call(&caller, RunId::new(), "call_tool", json!({}), &stream)
            .await
            .unwrap_err();
        assert_eq!(e.code, "unauthorized");
        let e = api
            .call(&caller, RunId::new(), "teleport", json!({}), &stream)
            .await
            .unwrap_err();
        assert_eq!(e.code, "not_found");
    }
}
