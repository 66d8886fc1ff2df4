//! `[providers]`: timeouts, retries and response caps of the model providers behind the
//! Host API's model actions.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::values::{MIB, nz32, nzu};

/// The model providers (OpenAI-compatible chat completions and `/rerank`) called by the
/// model actions of the Host API: `invoke_llm`, `invoke_llm_stream`, `rerank`. Every worker
/// and the gateway's remote Host API use the same values, so a call is served alike whichever
/// way it arrives. HTTP tools are not covered: each registered tool carries its own timeout
/// and response cap, and a tool call is never retried (it may have side effects).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProvidersConfig {
    /// Time limit of one attempt of a non-streaming model call (`invoke_llm`, `rerank`), and
    /// of the wait for a stream's response headers, e.g. `120s`; the run's remaining time
    /// bounds it further. Each retry gets the full limit again, but a retry that could not
    /// start before the run's deadline is not made (`deadline_exceeded`).
    #[serde(with = "humantime_serde")]
    pub model_timeout: Duration,
    /// Longest silence allowed between two chunks of a streamed model answer
    /// (`invoke_llm_stream`), e.g. `60s`. Once open (see `model_timeout`), a stream has no
    /// overall limit besides the run's deadline: it lives as long as it makes progress.
    #[serde(with = "humantime_serde")]
    pub stream_idle_timeout: Duration,
    /// Attempts of a model call, the first one included (`1` = never retry). Only `429`,
    /// `5xx` and connection failures are retried, and a stream only before its first chunk.
    pub max_attempts: NonZeroU32,
    /// Delay before the first retry, doubled for every further one, e.g. `250ms`.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// Largest body of a non-streaming model or rerank answer read, in bytes; a larger one
    /// fails the call with `payload_too_large`.
    pub max_response_bytes: NonZeroUsize,
    /// Time limit of opening a TCP (and TLS) connection to a model or tool provider, e.g.
    /// `10s`. A connection that cannot be opened in time fails the attempt as a retryable
    /// `unavailable`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for ProvidersConfig {
    fn default() -> Self {
        Self {
            // A long non-streaming completion from a large model takes a minute or more;
            // 120 s covers it, and a hung provider is still given up well before the default
            // 300 s run timeout.
            model_timeout: Duration::from_secs(120),
            // Once generating, providers send a chunk every few tokens; a minute of silence
            // still leaves room for a reasoning model's long time to first token.
            stream_idle_timeout: Duration::from_secs(60),
            // Two retries ride out a rate-limit blip or a restarting provider; more would
            // multiply the latency of a provider that is really down (each attempt may take
            // `model_timeout`) and the load on one that is shedding it.
            max_attempts: nz32(3),
            // Retries after 250 ms and 500 ms: invisible beside a model call, yet not an
            // immediate repeat into the overload that caused the `429`/`503`.
            retry_backoff: Duration::from_millis(250),
            // An answer is bounded by the run's output budget (100 000 characters by default,
            // under 1 MiB as JSON); 8 MiB leaves room for provider metadata such as logprobs
            // while bounding the worker memory one call can take.
            max_response_bytes: nzu(8 * MIB),
            // Far above any healthy handshake, even across continents; without it a host
            // that silently drops the attempt holds the call for the whole `model_timeout`.
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl ProvidersConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let pr = self;
        p.positive("providers.model_timeout", pr.model_timeout);
        p.positive("providers.stream_idle_timeout", pr.stream_idle_timeout);
        p.positive("providers.retry_backoff", pr.retry_backoff);
        p.positive("providers.connect_timeout", pr.connect_timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::values::KIB;
    use std::time::Duration;

    #[test]
    fn providers_are_set_by_file_environment_and_cli() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("providers.toml");
        std::fs::write(
            &file,
            r#"
            [providers]
            model_timeout = "45s"
            max_attempts = 2
            "#,
        )
        .unwrap();
        let vars = env(&[
            ("SWITCHBOARD__PROVIDERS__MAX_ATTEMPTS", "5"),
            ("SWITCHBOARD__PROVIDERS__STREAM_IDLE_TIMEOUT", "15s"),
            ("SWITCHBOARD__PROVIDERS__RETRY_BACKOFF", "40ms"),
            ("SWITCHBOARD__PROVIDERS__MAX_RESPONSE_BYTES", "65536"),
        ]);
        let c = loader().file(&file).env(vars.clone()).load().unwrap();
        let p = &c.providers;
        assert_eq!(p.model_timeout, Duration::from_secs(45), "file value kept");
        assert_eq!(p.max_attempts.get(), 5, "environment over file");
        assert_eq!(p.stream_idle_timeout, Duration::from_secs(15));
        assert_eq!(p.retry_backoff, Duration::from_millis(40));
        assert_eq!(p.max_response_bytes.get(), 64 * KIB);

        let c = loader()
            .file(&file)
            .env(vars)
            .set("providers.max_attempts", "1")
            .set("providers.model_timeout", "2m")
            .load()
            .unwrap();
        assert_eq!(c.providers.max_attempts.get(), 1, "CLI over environment");
        assert_eq!(c.providers.model_timeout, Duration::from_secs(120));
        assert_eq!(
            c.providers.retry_backoff,
            Duration::from_millis(40),
            "env value kept"
        );
    }

    #[test]
    fn rejects_zero_model_timeout() {
        assert_rejected("providers.model_timeout", "0s");
    }

    #[test]
    fn rejects_zero_stream_idle_timeout() {
        assert_rejected("providers.stream_idle_timeout", "0ms");
    }

    #[test]
    fn rejects_zero_max_attempts() {
        assert_load_error("providers.max_attempts", "0");
    }

    #[test]
    fn rejects_zero_retry_backoff() {
        assert_rejected("providers.retry_backoff", "0s");
    }

    #[test]
    fn rejects_zero_provider_connect_timeout() {
        assert_rejected("providers.connect_timeout", "0s");
    }

    #[test]
    fn rejects_zero_max_response_bytes() {
        assert_load_error("providers.max_response_bytes", "0");
    }

    #[test]
    fn rejects_unknown_providers_key() {
        let err = loader()
            .env(env(&[("SWITCHBOARD__PROVIDERS__TIMEOUT", "5s")]))
            .load()
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown field `timeout`"), "{msg}");
        assert!(msg.contains("`providers`"), "{msg}");
    }
}
