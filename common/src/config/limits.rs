//! `[limits]` and `[limits.budgets]`: what runners and API clients may send or request
//! (SPEC §13), and the per-run budgets (SPEC §8).

use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use serde::Deserialize;

use super::problems::Problems;
use super::values::{KIB, MIB, nz32, nzu};

/// Per-run budgets (SPEC §8); agents may override them. Once exhausted a budget stays
/// exhausted for the run (`budget_exceeded`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetsConfig {
    /// Model invocations per run.
    pub max_model_calls: NonZeroU32,
    /// Tool calls per run.
    pub max_tool_calls: NonZeroU32,
    /// Characters of tool results returned to the runner per run.
    pub max_tool_result_chars: NonZeroUsize,
    /// Characters of model output returned to the runner per run.
    pub max_model_output_chars: NonZeroUsize,
}

impl Default for BudgetsConfig {
    fn default() -> Self {
        // SPEC §8 / §13 defaults.
        Self {
            max_model_calls: nz32(16),
            max_tool_calls: nz32(32),
            max_tool_result_chars: nzu(100_000),
            max_model_output_chars: nzu(100_000),
        }
    }
}

/// Limits on what runners and API clients may send or request (SPEC §13).
///
/// Not here: the transcript's searchable text is cut to 4,000 characters by the store
/// (`sb_store::transcript::MAX_TRANSCRIPT_CONTENT_CHARS`, seed behaviour; the full item is
/// kept beside it), an invariant of the stored data rather than a per-deployment setting.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest state value, in bytes of UTF-8 JSON.
    pub state_value_bytes: NonZeroUsize,
    /// Largest plugin/workspace storage value, in bytes.
    pub storage_value_bytes: NonZeroUsize,
    /// Largest inline artifact content (`artifact.created.content_base64`), decoded bytes.
    pub artifact_inline_bytes: NonZeroUsize,
    /// Bytes returned by an artifact read that gives no `limit`.
    pub artifact_read_default_bytes: NonZeroUsize,
    /// Upper cap on any artifact read `limit`.
    pub artifact_read_max_bytes: NonZeroUsize,
    /// Largest artifact `POST /v1/artifacts` accepts, decoded bytes (`413` above). At most
    /// `artifact_read_max_bytes`, which is also the store's cap on any artifact.
    pub artifact_upload_bytes: NonZeroUsize,
    /// Default page size for history and event pages.
    pub page_size_default: NonZeroU32,
    /// Default page size for state listings.
    pub state_page_size_default: NonZeroU32,
    /// Largest page size (requested limits are clamped to `[1, page_size_max]`); also caps
    /// history search `top_k`.
    pub page_size_max: NonZeroU32,
    /// Steering items queued per run; a full queue sends the event to normal dispatch.
    pub steering_queue_items: NonZeroU32,
    /// Most steering items returned by one pull.
    pub steering_pull_max: NonZeroU32,
    /// Event input summary length, in characters.
    pub input_summary_chars: NonZeroUsize,
    /// Longest string kept in an event's `data`, in UTF-8 bytes (larger → use an artifact).
    pub event_data_string_bytes: NonZeroUsize,
    /// Most documents per rerank call (`invoke_rerank`); a call with more is refused with
    /// `invalid_argument` naming this limit.
    pub rerank_documents_max: NonZeroU32,
    /// Host API calls a run may make per second (token bucket refill); unset disables the
    /// per-run rate limit.
    pub proxy_calls_per_second: Option<NonZeroU32>,
    /// Host API calls a run may make in a burst (token bucket size).
    pub proxy_calls_burst: NonZeroU32,
    /// Longest `timeout_ms` an HTTP tool may be registered with (`POST /v1/tools` refuses
    /// more), and the most one call waits at execution whatever the tool was registered
    /// with: a call holds a worker's attention (and the run's slot) for that long. Whole
    /// milliseconds, at least `1ms`.
    #[serde(with = "humantime_serde")]
    pub tool_timeout_max: Duration,
    /// Largest `max_response_bytes` an HTTP tool may be registered with, and the most of a
    /// tool's answer a worker buffers at execution whatever the tool was registered with.
    pub tool_response_bytes_max: NonZeroUsize,
    /// `/v1` requests one API key may make per second (token bucket refill); more are
    /// refused with `429 rate_limited` and `Retry-After`. Unset disables the limit.
    pub requests_per_second_per_key: Option<NonZeroU32>,
    /// `/v1` requests one API key may make in a burst (token bucket size).
    pub requests_burst_per_key: NonZeroU32,
    /// Result streams (SSE) one API key may hold open at once; one more is refused with
    /// `429 rate_limited`.
    pub streams_per_key: NonZeroU32,
    /// Most result items one run may produce, its terminal item included. A runner that keeps
    /// streaming past `run_items_max - 1` items has its run ended with `run.failed`
    /// (`runner.too_many_items`); a terminal item within the limit is still accepted.
    pub run_items_max: NonZeroU64,
    /// How far in the future `deliver_at` on `POST /v1/events` may be (`400` beyond). A
    /// delayed event waits in the event log, so keep this below the event log's retention.
    #[serde(with = "humantime_serde")]
    pub deliver_at_max_delay: Duration,
    /// Longest a run without a deadline may stay active (`queued` or `running`), from its
    /// creation: the orchestrator's reaper then finalizes it as `timeout`. Runs with a
    /// deadline end at their deadline; this bounds the others, so no run lives forever.
    #[serde(with = "humantime_serde")]
    pub run_max_duration: Duration,
    /// Per-run budgets.
    pub budgets: BudgetsConfig,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        // Values from SPEC §13, which follow the seed host (host-behaviour §1).
        Self {
            state_value_bytes: nzu(256 * KIB),
            storage_value_bytes: nzu(10 * MIB),
            artifact_inline_bytes: nzu(MIB),
            artifact_read_default_bytes: nzu(MIB),
            artifact_read_max_bytes: nzu(10 * MIB),
            // As much as the store keeps: an uploaded artifact is read back in ranges.
            artifact_upload_bytes: nzu(10 * MIB),
            page_size_default: nz32(50),
            state_page_size_default: nz32(100),
            page_size_max: nz32(100),
            steering_queue_items: nz32(100),
            steering_pull_max: nz32(100),
            input_summary_chars: nzu(1000),
            event_data_string_bytes: nzu(512),
            rerank_documents_max: nz32(64),
            // Budgets bound the expensive calls; the rate limit only stops a runner stuck in a
            // tight loop of cheap calls from saturating the worker. 100/s with a 200 burst is
            // far above any legitimate agent loop.
            proxy_calls_per_second: Some(nz32(100)),
            proxy_calls_burst: nz32(200),
            // The bounds `/v1/tools` enforced before they were configurable, so tools
            // registered then stay within them. Two minutes matches `providers.model_timeout`,
            // the other external call of a run; 16 MiB is twice `providers.max_response_bytes`
            // (a tool may return a document), while the default `max_tool_result_chars`
            // budget already refuses answers far smaller than either.
            tool_timeout_max: Duration::from_secs(120),
            tool_response_bytes_max: nzu(16 * MIB),
            // Far above what one client of a 2-core host can use (every request is a
            // database transaction or a stream), so only a runaway or hostile client meets it;
            // the burst absorbs a client's reconnect storm.
            requests_per_second_per_key: Some(nz32(2_000)),
            requests_burst_per_key: nz32(4_000),
            // Each stream holds a connection and a bus subscription; 1 000 per key covers a
            // busy chat front end while one key cannot exhaust a gateway's file descriptors.
            streams_per_key: nz32(1_000),
            // A long streamed answer is a few thousand deltas; 10 000 leaves room for the
            // longest legitimate run while one runaway runner cannot fill the ledger.
            run_items_max: NonZeroU64::new(10_000).expect("non-zero"),
            // A week covers reminders and follow-ups while staying well inside the event
            // log's 30-day retention, so a delayed event is never deleted before it is due.
            deliver_at_max_delay: Duration::from_secs(7 * 24 * 3600),
            // A day: far above any interactive run, and as long as the orchestrator keeps the
            // session of a run without a deadline.
            run_max_duration: Duration::from_secs(24 * 3600),
            budgets: BudgetsConfig::default(),
        }
    }
}

impl LimitsConfig {
    /// Adds a problem for every rule of this section that the values break.
    pub(super) fn validate(&self, p: &mut Problems) {
        let l = self;
        p.positive("limits.deliver_at_max_delay", l.deliver_at_max_delay);
        p.positive("limits.run_max_duration", l.run_max_duration);
        if l.tool_timeout_max < Duration::from_millis(1) {
            // Tool timeouts are whole milliseconds: a smaller ceiling would refuse every tool.
            p.push(
                "limits.tool_timeout_max",
                "expected a duration of at least 1ms",
            );
        }
        if l.artifact_upload_bytes > l.artifact_read_max_bytes {
            p.push(
                "limits.artifact_upload_bytes",
                format!(
                    "expected at most limits.artifact_read_max_bytes ({}), got {}",
                    l.artifact_read_max_bytes, l.artifact_upload_bytes
                ),
            );
        }
        if l.artifact_read_default_bytes > l.artifact_read_max_bytes {
            p.push(
                "limits.artifact_read_default_bytes",
                format!(
                    "expected at most limits.artifact_read_max_bytes ({}), got {}",
                    l.artifact_read_max_bytes, l.artifact_read_default_bytes
                ),
            );
        }
        for (key, value) in [
            ("limits.page_size_default", l.page_size_default),
            ("limits.state_page_size_default", l.state_page_size_default),
        ] {
            if value > l.page_size_max {
                p.push(
                    key,
                    format!(
                        "expected at most limits.page_size_max ({}), got {value}",
                        l.page_size_max
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::values::MIB;
    use super::*;

    #[test]
    fn rejects_zero_run_items_max() {
        assert_load_error("limits.run_items_max", "0");
    }

    #[test]
    fn rejects_artifact_read_default_above_cap() {
        assert_rejected("limits.artifact_read_default_bytes", (11 * MIB).to_string());
    }

    #[test]
    fn rejects_page_size_default_above_max() {
        assert_rejected("limits.page_size_default", "101");
    }

    #[test]
    fn rejects_state_page_size_default_above_max() {
        assert_rejected("limits.state_page_size_default", "500");
    }

    #[test]
    fn tool_ceilings_are_configurable() {
        let c = loader()
            .set("limits.tool_timeout_max", "30s")
            .set("limits.tool_response_bytes_max", "65536")
            .load()
            .unwrap();
        assert_eq!(c.limits.tool_timeout_max, Duration::from_secs(30));
        assert_eq!(c.limits.tool_response_bytes_max.get(), 65536);
        let d = LimitsConfig::default();
        assert_eq!(d.tool_timeout_max, Duration::from_secs(120));
        assert_eq!(d.tool_response_bytes_max.get(), 16 * MIB);
    }

    #[test]
    fn rejects_a_zero_run_max_duration() {
        assert_rejected("limits.run_max_duration", "0s");
    }

    #[test]
    fn rejects_a_zero_deliver_at_max_delay() {
        assert_rejected("limits.deliver_at_max_delay", "0s");
    }

    #[test]
    fn rejects_tool_timeout_max_below_a_millisecond() {
        assert_rejected("limits.tool_timeout_max", "0s");
        assert_rejected("limits.tool_timeout_max", "999us");
    }

    #[test]
    fn rejects_zero_tool_response_bytes_max() {
        assert_load_error("limits.tool_response_bytes_max", "0");
    }

    #[test]
    fn rejects_zero_budget() {
        assert_load_error("limits.budgets.max_model_calls", "0");
    }
}
