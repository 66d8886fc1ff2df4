//! Logging initialisation, metric names and a small Prometheus registry.
//!
//! - [`TelemetryConfig`] is the `[telemetry]` section of the configuration; `sb_common::config`
//!   re-exports it and validates it (this module does not depend on `config`).
//! - [`init`] installs the global `tracing` subscriber (text or JSON, `EnvFilter`).
//! - [`names`] holds every metric name, so a name is spelled once and grep finds its users.
//!   Names follow `sb_<noun>_<unit>[_total]`; labels are low-cardinality only (a status, an
//!   action, a queue kind). Never put a run id, event id or conversation id in a label.
//! - [`Metrics`] keeps counters, gauges and histograms keyed by name + labels and renders
//!   them in the Prometheus text format for `GET /metrics`; storage and rendering are the
//!   `metrics-exporter-prometheus` recorder's.

use std::net::SocketAddr;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

use serde::Deserialize;

/// The `[telemetry]` section of the configuration (re-exported as
/// `sb_common::config::TelemetryConfig`): logging, and where a process without the gateway
/// serves its metrics.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Log filter in `tracing` `EnvFilter` syntax, e.g. `info` or `info,sb_worker=debug`.
    /// `RUST_LOG`, when set, takes precedence (the usual Rust convention).
    pub log_level: String,
    /// Write logs as JSON lines (for log shippers) instead of human-readable text.
    pub json: bool,
    /// Where a process without the gateway role (an orchestrator, a worker) serves
    /// `GET /metrics`, `/healthz` and `/readyz`, e.g. `0.0.0.0:9090`. Unset: not served (the
    /// default, so several roles on one host never fight over a port). A gateway serves them
    /// on `gateway.http_addr` and ignores this key.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_level: "info".to_owned(),
            json: false,
            metrics_listen: None,
        }
    }
}

/// Why logging could not be initialised.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log filter does not parse.
    #[error("invalid log filter `{filter}`: {reason}")]
    InvalidFilter {
        /// The rejected filter text.
        filter: String,
        /// The parser's explanation.
        reason: String,
    },
    /// A global subscriber is already installed (e.g. `init` called twice).
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
}

/// Parses a filter in `EnvFilter` syntax (`info`, `info,sb_worker=debug`).
pub fn parse_filter(filter: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(filter).map_err(|e| TelemetryError::InvalidFilter {
        filter: filter.to_owned(),
        reason: e.to_string(),
    })
}

/// Installs the global `tracing` subscriber: `config.log_level` (or `RUST_LOG` when set and
/// non-empty, the usual Rust convention), text or JSON lines on stderr.
pub fn init(config: &TelemetryConfig) -> Result<(), TelemetryError> {
    let filter_text = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| config.log_level.clone());
    let filter = parse_filter(&filter_text)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if config.json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init()
    } else {
        builder.try_init()
    };
    result.map_err(|_| TelemetryError::AlreadyInitialized)
}

/// Every metric name, with its kind and help text in [`DEFINITIONS`].
pub mod names {
    /// Counter `{outcome = accepted|duplicate|rejected|scheduled}`: events received by
    /// `POST /v1/events`, and (`scheduled`) events ingested by firing schedules.
    pub const EVENTS_INGESTED_TOTAL: &str = "sb_events_ingested_total";
    /// Counter `{outcome = dispatched|steered|unrouted|rejected|enqueued}`: events routed.
    pub const EVENTS_ROUTED_TOTAL: &str = "sb_events_routed_total";
    /// Counter `{status}`: runs that reached a terminal status.
    pub const RUNS_TOTAL: &str = "sb_runs_total";
    /// Gauge: runs currently executing on this worker.
    pub const RUNS_ACTIVE: &str = "sb_runs_active";
    /// Histogram `{status = completed|failed|cancelled}`: run duration from the worker's claim
    /// to its terminal result published.
    pub const RUN_DURATION_SECONDS: &str = "sb_run_duration_seconds";
    /// Histogram: from the event's acceptance (its ledger row) to the run's first result
    /// published by the worker (the live hop to a follower adds a few milliseconds).
    pub const RUN_FIRST_RESULT_SECONDS: &str = "sb_run_first_result_seconds";
    /// Counter `{type}`: results persisted, by result type.
    pub const RUN_RESULTS_TOTAL: &str = "sb_run_results_total";
    /// Counter `{action, result}`: Host API calls; `result` is `ok` or an error code.
    pub const PROXY_CALLS_TOTAL: &str = "sb_proxy_calls_total";
    /// Histogram `{action}`: Host API call latency.
    pub const PROXY_CALL_DURATION_SECONDS: &str = "sb_proxy_call_duration_seconds";
    /// Counter `{exchange}`: messages published with a broker confirm.
    pub const BUS_PUBLISHED_TOTAL: &str = "sb_bus_published_total";
    /// Counter `{exchange}`: best-effort messages the bus refused for good (an invalid
    /// routing key, a body over the broker's limit) and that were dropped, not retried.
    pub const BUS_PUBLISH_REFUSED_TOTAL: &str = "sb_bus_publish_refused_total";
    /// Counter `{queue, disposition = ack|retry|dead_letter}`: messages consumed.
    pub const BUS_CONSUMED_TOTAL: &str = "sb_bus_consumed_total";
    /// Counter `{queue}`: AMQP frames sent to settle consumed messages; below
    /// `sb_bus_consumed_total` by what acks coalesced with `multiple` saved.
    pub const BUS_SETTLE_FRAMES_TOTAL: &str = "sb_bus_settle_frames_total";
    /// Histogram `{queue}`: time between publish and consume (queue lag).
    pub const QUEUE_LAG_SECONDS: &str = "sb_queue_lag_seconds";
    /// Gauge: outbox rows committed but not yet published.
    pub const OUTBOX_PENDING: &str = "sb_outbox_pending";
    /// Gauge `{mode = shared|per_run}`: runner processes alive on this worker.
    pub const RUNNER_PROCESSES: &str = "sb_runner_processes";
    /// Counter `{reason = crashed}`: unexpected exits of a shared runner process, each
    /// followed by a restart (after the backoff) when its workspace has another run.
    pub const RUNNER_RESTARTS_TOTAL: &str = "sb_runner_restarts_total";
    /// Counter `{budget}`: Host API calls refused with `budget_exceeded`, by budget
    /// (`model_calls`, `tool_calls`, `model_output_chars`).
    pub const BUDGET_REFUSALS_TOTAL: &str = "sb_budget_refusals_total";
    /// Counter `{method, route, status}`: HTTP requests (route is the matched path template).
    pub const HTTP_REQUESTS_TOTAL: &str = "sb_http_requests_total";
    /// Histogram `{method, route}`: HTTP request latency.
    pub const HTTP_REQUEST_DURATION_SECONDS: &str = "sb_http_request_duration_seconds";
    /// Counter `{error_type, stage}`: errors worth alerting on (vector's convention; retried
    /// failures are not data loss and are counted under their own stage).
    pub const ERRORS_TOTAL: &str = "sb_errors_total";
    /// Counter `{kind = run_results|artifacts|outbox|event_log|transcript|turn_identities}`:
    /// rows the retention task deleted (for `run_results`, runs whose items were deleted).
    pub const RETENTION_DELETED_TOTAL: &str = "sb_retention_deleted_total";
}

/// The three Prometheus metric types we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic count.
    Counter,
    /// Value that goes up and down.
    Gauge,
    /// Distribution over [`LATENCY_BUCKETS`].
    Histogram,
}

/// A metric's name, kind and help text.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Prometheus name (one of [`names`]).
    pub name: &'static str,
    /// Type.
    pub kind: MetricKind,
    /// `# HELP` text.
    pub help: &'static str,
}

/// The known metrics. Names used without a definition still work; they render without help.
pub const DEFINITIONS: &[MetricDef] = &[
    def(
        names::EVENTS_INGESTED_TOTAL,
        MetricKind::Counter,
        "Events received by the API, by outcome.",
    ),
    def(
        names::EVENTS_ROUTED_TOTAL,
        MetricKind::Counter,
        "Events routed by the orchestrator, by outcome.",
    ),
    def(
        names::RUNS_TOTAL,
        MetricKind::Counter,
        "Runs that reached a terminal status, by status.",
    ),
    def(
        names::RUNS_ACTIVE,
        MetricKind::Gauge,
        "Runs currently executing on this worker.",
    ),
    def(
        names::RUN_DURATION_SECONDS,
        MetricKind::Histogram,
        "Run duration from claim to terminal result.",
    ),
    def(
        names::RUN_FIRST_RESULT_SECONDS,
        MetricKind::Histogram,
        "Time from the event's acceptance to the run's first result published.",
    ),
    def(
        names::RUN_RESULTS_TOTAL,
        MetricKind::Counter,
        "Run results persisted, by result type.",
    ),
    def(
        names::PROXY_CALLS_TOTAL,
        MetricKind::Counter,
        "Host API calls by action and result.",
    ),
    def(
        names::PROXY_CALL_DURATION_SECONDS,
        MetricKind::Histogram,
        "Host API call latency by action.",
    ),
    def(
        names::BUS_PUBLISHED_TOTAL,
        MetricKind::Counter,
        "Messages published and confirmed, by exchange.",
    ),
    def(
        names::BUS_PUBLISH_REFUSED_TOTAL,
        MetricKind::Counter,
        "Best-effort messages the bus refused for good and that were dropped, by exchange.",
    ),
    def(
        names::BUS_CONSUMED_TOTAL,
        MetricKind::Counter,
        "Messages consumed, by queue and disposition.",
    ),
    def(
        names::BUS_SETTLE_FRAMES_TOTAL,
        MetricKind::Counter,
        "AMQP frames that settled consumed messages (one multiple ack settles several), by queue.",
    ),
    def(
        names::QUEUE_LAG_SECONDS,
        MetricKind::Histogram,
        "Time from publish to consume, by queue.",
    ),
    def(
        names::OUTBOX_PENDING,
        MetricKind::Gauge,
        "Outbox rows committed but not yet published.",
    ),
    def(
        names::RUNNER_PROCESSES,
        MetricKind::Gauge,
        "Runner processes alive on this worker, by mode.",
    ),
    def(
        names::RUNNER_RESTARTS_TOTAL,
        MetricKind::Counter,
        "Runner process restarts, by reason.",
    ),
    def(
        names::BUDGET_REFUSALS_TOTAL,
        MetricKind::Counter,
        "Host API calls refused because a run budget was exhausted, by budget.",
    ),
    def(
        names::HTTP_REQUESTS_TOTAL,
        MetricKind::Counter,
        "HTTP requests by method, route and status.",
    ),
    def(
        names::HTTP_REQUEST_DURATION_SECONDS,
        MetricKind::Histogram,
        "HTTP request latency by method and route.",
    ),
    def(
        names::RETENTION_DELETED_TOTAL,
        MetricKind::Counter,
        "Rows deleted by the retention task, by kind.",
    ),
    def(
        names::ERRORS_TOTAL,
        MetricKind::Counter,
        "Errors by type and stage.",
    ),
];

const fn def(name: &'static str, kind: MetricKind, help: &'static str) -> MetricDef {
    MetricDef { name, kind, help }
}

/// Histogram bucket bounds in seconds: 1 ms (the per-hop latency we aim for) up to 5 min (the
/// default run timeout).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// How often the process-wide registry folds recorded histogram samples into its buckets. The
/// recorder buffers samples until a render or an upkeep; without upkeep a process nobody
/// scrapes would buffer them forever.
const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Metadata of every series we record (the recorder ignores it; the API requires one).
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new("switchboard", metrics::Level::INFO, None);

/// Counters, gauges and histograms keyed by name + labels, rendered in the Prometheus text
/// exposition format: a thin, name-checked front of the `metrics` crate's Prometheus recorder
/// (`metrics-exporter-prometheus`), which does the storage and the rendering.
///
/// Why a front and not the `metrics::counter!` macros at every call site: the recorder is
/// owned, not installed globally, so tests get isolated registries ([`Metrics::new`]) and
/// the process-wide one ([`Metrics::global`]) cannot be replaced by a library that installs
/// its own recorder; and every name goes through [`names`], which keeps `DEFINITIONS` the one
/// list of what a role exports (with its help text and histogram buckets).
///
/// Labels are sorted by key, so the same labels in another order are the same series. Labels
/// must stay low-cardinality (a status, an action, a queue kind; never an id).
///
/// ```
/// use sb_common::telemetry::{Metrics, names};
/// let metrics = Metrics::new();
/// metrics.inc(names::RUNS_TOTAL, &[("status", "completed")]);
/// assert!(metrics.render().contains("sb_runs_total{status=\"completed\"} 1\n"));
/// ```
pub struct Metrics {
    recorder: metrics_exporter_prometheus::PrometheusRecorder,
    handle: metrics_exporter_prometheus::PrometheusHandle,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry with every [`DEFINITIONS`] entry described and histograms bucketed by
    /// [`LATENCY_BUCKETS`].
    pub fn new() -> Self {
        use metrics::Recorder as _;
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(LATENCY_BUCKETS)
            .expect("LATENCY_BUCKETS is not empty")
            .build_recorder();
        for d in DEFINITIONS {
            let name = metrics::KeyName::from_const_str(d.name);
            let help = metrics::SharedString::const_str(d.help);
            match d.kind {
                MetricKind::Counter => recorder.describe_counter(name, None, help),
                MetricKind::Gauge => recorder.describe_gauge(name, None, help),
                MetricKind::Histogram => recorder.describe_histogram(name, None, help),
            }
        }
        let handle = recorder.handle();
        Self { recorder, handle }
    }

    /// The process-wide registry that `GET /metrics` renders.
    pub fn global() -> &'static Metrics {
        static GLOBAL: OnceLock<Metrics> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let registry = Metrics::new();
            let handle = registry.handle.clone();
            // A plain thread: the registry outlives any runtime, and upkeep is a few
            // microseconds every few seconds.
            let _ = std::thread::Builder::new()
                .name("sb-metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(UPKEEP_INTERVAL);
                        handle.run_upkeep();
                    }
                });
            registry
        })
    }

    /// Adds 1 to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.add(name, labels, 1);
    }

    /// Adds `value` to a counter.
    pub fn add(&self, name: &'static str, labels: &[(&'static str, &str)], value: u64) {
        use metrics::Recorder as _;
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
            .increment(value);
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, labels: &[(&'static str, &str)], value: f64) {
        use metrics::Recorder as _;
        self.recorder
            .register_gauge(&key(name, labels), &METADATA)
            .set(value);
    }

    /// Adds `delta` (may be negative) to a gauge.
    pub fn gauge_add(&self, name: &'static str, labels: &[(&'static str, &str)], delta: f64) {
        use metrics::Recorder as _;
        self.recorder
            .register_gauge(&key(name, labels), &METADATA)
            .increment(delta);
    }

    /// Records one observation (seconds for the latency histograms).
    pub fn observe(&self, name: &'static str, labels: &[(&'static str, &str)], value: f64) {
        use metrics::Recorder as _;
        self.recorder
            .register_histogram(&key(name, labels), &METADATA)
            .record(value);
    }

    /// Current value of a counter (for tests and assertions), read from the rendered text.
    pub fn counter_value(&self, name: &str, labels: &[(&'static str, &str)]) -> Option<u64> {
        let mut sorted = labels.to_vec();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let series = if sorted.is_empty() {
            name.to_owned()
        } else {
            let parts: Vec<String> = sorted
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                .collect();
            format!("{name}{{{}}}", parts.join(","))
        };
        self.render().lines().find_map(|line| {
            let (head, value) = line.rsplit_once(' ')?;
            (head == series).then(|| value.parse().ok())?
        })
    }

    /// Everything in the Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        self.handle.render()
    }
}

/// The recorder's key: the name and the labels sorted by key.
fn key(name: &'static str, labels: &[(&'static str, &str)]) -> metrics::Key {
    let mut labels: Vec<metrics::Label> = labels
        .iter()
        .map(|(k, v)| metrics::Label::new(*k, (*v).to_owned()))
        .collect();
    labels.sort_unstable_by(|a, b| a.key().cmp(b.key()));
    metrics::Key::from_parts(name, labels)
}

/// Label value escaping of the exposition format (as the recorder renders them).
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_definition_is_unique_and_follows_the_naming_rule() {
        let mut seen = std::collections::HashSet::new();
        for d in DEFINITIONS {
            assert!(seen.insert(d.name), "duplicate {}", d.name);
            assert!(d.name.starts_with("sb_"), "{}", d.name);
            match d.kind {
                MetricKind::Counter => assert!(d.name.ends_with("_total"), "{}", d.name),
                _ => assert!(!d.name.ends_with("_total"), "{}", d.name),
            }
            if d.kind == MetricKind::Histogram {
                assert!(d.name.ends_with("_seconds"), "{}", d.name);
            }
        }
    }

    fn has_line(text: &str, line: &str) -> bool {
        text.lines().any(|l| l == line)
    }

    #[test]
    fn counters_render_with_help_type_and_sorted_labels() {
        let r = Metrics::new();
        r.inc(
            names::PROXY_CALLS_TOTAL,
            &[("result", "ok"), ("action", "invoke_llm")],
        );
        r.add(
            names::PROXY_CALLS_TOTAL,
            &[("action", "invoke_llm"), ("result", "ok")],
            2,
        );
        r.inc(
            names::PROXY_CALLS_TOTAL,
            &[("action", "call_tool"), ("result", "unauthorized")],
        );
        assert_eq!(
            r.counter_value(
                names::PROXY_CALLS_TOTAL,
                &[("result", "ok"), ("action", "invoke_llm")]
            ),
            Some(3)
        );
        let text = r.render();
        for line in [
            "# HELP sb_proxy_calls_total Host API calls by action and result.",
            "# TYPE sb_proxy_calls_total counter",
            "sb_proxy_calls_total{action=\"call_tool\",result=\"unauthorized\"} 1",
            "sb_proxy_calls_total{action=\"invoke_llm\",result=\"ok\"} 3",
        ] {
            assert!(has_line(&text, line), "missing `{line}` in\n{text}");
        }
    }

    #[test]
    fn gauges_set_and_add() {
        let r = Metrics::new();
        r.set(names::OUTBOX_PENDING, &[], 5.0);
        r.gauge_add(names::OUTBOX_PENDING, &[], -2.0);
        r.gauge_add(names::RUNS_ACTIVE, &[], 1.5);
        let text = r.render();
        assert!(has_line(&text, "# TYPE sb_outbox_pending gauge"), "{text}");
        assert!(has_line(&text, "sb_outbox_pending 3"), "{text}");
        assert!(has_line(&text, "sb_runs_active 1.5"), "{text}");
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let r = Metrics::new();
        for v in [0.0005, 0.003, 0.003, 1000.0] {
            r.observe(names::QUEUE_LAG_SECONDS, &[("queue", "events")], v);
        }
        let text = r.render();
        for line in [
            "# TYPE sb_queue_lag_seconds histogram",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.001\"} 1",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.0025\"} 1",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.005\"} 3",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"300\"} 3",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"+Inf\"} 4",
            "sb_queue_lag_seconds_count{queue=\"events\"} 4",
        ] {
            assert!(has_line(&text, line), "missing `{line}` in\n{text}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("sb_queue_lag_seconds_sum{queue=\"events\"} 1000.006")),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let r = Metrics::new();
        r.inc(
            names::ERRORS_TOTAL,
            &[("error_type", "a\"b\\c\nd"), ("stage", "x")],
        );
        assert_eq!(
            r.counter_value(
                names::ERRORS_TOTAL,
                &[("error_type", "a\"b\\c\nd"), ("stage", "x")]
            ),
            Some(1),
            "{}",
            r.render()
        );
    }

    #[test]
    fn undefined_names_render_without_help() {
        let r = Metrics::new();
        r.inc("sb_custom_things_total", &[]);
        let text = r.render();
        assert!(has_line(&text, "sb_custom_things_total 1"), "{text}");
        assert!(!text.contains("# HELP sb_custom_things_total"), "{text}");
    }

    #[test]
    fn registries_are_isolated() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.inc(names::RUNS_TOTAL, &[("status", "completed")]);
        assert_eq!(
            b.counter_value(names::RUNS_TOTAL, &[("status", "completed")]),
            None
        );
    }

    #[test]
    fn filters_parse_or_are_rejected() {
        parse_filter("info,sb_worker=debug").unwrap();
        assert!(matches!(
            parse_filter("info,=["),
            Err(TelemetryError::InvalidFilter { .. })
        ));
    }
}
